"""Process memory: peak RSS, and handing freed heap pages back to the OS."""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import sys


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (0 where the platform does not say)."""
    try:
        import resource                                 # POSIX only
    except ImportError:
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024     # macOS reports bytes, Linux KiB


def release_free_memory(collect: bool = False) -> bool:
    """Hand free heap pages back to the OS (glibc `malloc_trim`), after a garbage collection
    when `collect` (slow in a process with many Python objects: leave it to the last call).

    Freed tensors below glibc's mmap threshold stay in the heap and keep counting toward
    RSS; trimming returns them. Returns whether a trim ran (False off glibc)."""
    if collect:
        gc.collect()
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


_LIBC: list = []


def _libc():
    if not _LIBC:
        name = ctypes.util.find_library("c") if sys.platform.startswith("linux") else None
        lib = ctypes.CDLL(name) if name else None
        _LIBC.append(lib if lib is not None and hasattr(lib, "malloc_trim") else None)
    return _LIBC[0]


def available_bytes() -> int | None:
    """Memory the kernel says a new allocation can get without swapping (MemAvailable), or None."""
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_fits(needed: int, what: str, budget: int | None = None) -> None:
    """Refuse up front (BudgetError with the figures) a load needing more than `budget` bytes, or
    more than the memory available now: never an OOM kill half-way through."""
    from ..errors import BudgetError
    limit = budget if budget is not None else available_bytes()
    if limit is not None and needed > limit:
        where = "the memory budget" if budget is not None else "the memory available (MemAvailable)"
        raise BudgetError(f"{what} needs {needed / 2**30:.2f} GiB but {where} is {limit / 2**30:.2f} GiB; "
                            "free memory, or load a smaller model or format")


def weight_memory(model) -> dict:
    """Bytes of the model's distinct weight tensors: resident in this process's memory, and views
    of a mapped file (`model.kvboost_mapped`: address ranges), which the page cache holds."""
    import itertools
    ranges = getattr(model, "kvboost_mapped", ())
    seen, resident, mapped = set(), 0, 0
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        if tensor.is_meta or tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        size = tensor.numel() * tensor.element_size()
        if any(start <= tensor.data_ptr() < end for start, end in ranges):
            mapped += size
        else:
            resident += size
    return {"weights_resident_bytes": resident, "weights_mapped_bytes": mapped}


def float_model_bytes(source, config, dtype) -> int:
    """Bytes a float model of the checkpoint in `source` takes in `dtype`: its safetensors files
    scaled from the stored float width (config.dtype / torch_dtype, else float32)."""
    import torch
    from pathlib import Path
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    if isinstance(stored, str):
        stored = getattr(torch, stored, torch.float32)
    files = sum(f.stat().st_size for f in model_files(Path(source)))
    return files * torch.empty(0, dtype=dtype).element_size() // torch.empty(0, dtype=stored).element_size()


def model_files(source) -> list:
    """The safetensors files transformers loads from `source`: those its index's weight_map names, else
    every one but Mistral's `consolidated*` (the same weights in Mistral's own layout, which repositories
    ship beside the HF files)."""
    import json
    index = source / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = set(json.loads(index.read_text())["weight_map"].values())
            return [source / name for name in sorted(names) if (source / name).is_file()]
        except (OSError, ValueError, KeyError, AttributeError, TypeError):
            pass                        # an unreadable index: transformers will say so when it loads
    return [f for f in sorted(source.glob("*.safetensors")) if not f.name.startswith("consolidated")]
