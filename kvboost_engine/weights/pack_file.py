"""A file of named tensors written one at a time and mapped back without a copy (the repack cache).

`PackWriter` appends each tensor as it is made (64-byte aligned) and keeps only its index, so
writing a model's repacked weights holds one tensor in memory at a time; `finish` writes the index
(JSON: name -> dtype, shape, offset, plus free-form metadata) beside the data. `read_pack` checks the
data file against the index's checksum (xxh3, ~0.1 s a GB from the page cache) and places it in one
of two ways (`huge_pages()` decides; every tensor is a view of the one buffer either way):
  huge pages   read into private anonymous memory asked for in transparent huge pages
               (MADV_HUGEPAGE): 2 MB pages, so a step streaming the weights misses the TLB 512x
               less often (the random SmolLM2-1.7B-shape Q4_0 decoded at 37.4-38.4 tok/s against
               28.9-36.3 mapped, llama.cpp 31.8-34.6, in one run). The default where the kernel's
               THP setting allows it ("always" or "madvise").
  mapped       the file mapped copy-on-write: read from disk on first touch and never copied, its
               pages the page cache's, shared with other processes mapping the same file (one
               copy of a model's weights for several processes). The default where THP is off;
               $KVBOOST_WEIGHTS_HUGE_PAGES=0 asks for it (1: huge pages).
"""
from __future__ import annotations

import ctypes
import json
import logging
import mmap
import os
from pathlib import Path
from typing import NamedTuple

import torch
import xxhash

from ..errors import InputError

ALIGN = 64
FORMAT = "kvboost-pack-1"
HUGE_PAGES_ENV = "KVBOOST_WEIGHTS_HUGE_PAGES"     # "1" / "0": weights in huge pages, or the file mapped
HUGE_PAGE = 2 << 20                               # a transparent huge page on x86-64
READ_CHUNK = 8 << 20                              # bytes a read asks for (one read of a whole GB was 10x slower)
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
log = logging.getLogger(__name__)
_DTYPES = {str(t).removeprefix("torch."): t for t in (torch.uint8, torch.int8, torch.int16, torch.int32,
                                                    torch.float16, torch.bfloat16, torch.float32)}


class PackWriter:
    """Append tensors to `data` (a path); `finish(meta)` writes `index` and closes."""

    def __init__(self, data: Path, index: Path):
        self.data, self.index = data, index
        self._out = open(data, "wb")
        self._entries: dict[str, dict] = {}
        self._hash = xxhash.xxh3_64()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._entries:
            raise ValueError(f"tensor {name} written twice")
        tensor = tensor.detach().contiguous()
        pad = -self._out.tell() % ALIGN
        self._write(b"\0" * pad)
        offset = self._out.tell()
        self._write(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
        self._entries[name] = {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
                               "offset": offset}

    def _write(self, chunk: bytes) -> None:
        self._out.write(chunk)
        self._hash.update(chunk)

    def finish(self, meta: dict) -> None:
        self._out.flush()
        os.fsync(self._out.fileno())
        self._out.close()
        self.index.write_text(json.dumps({"format": FORMAT, "bytes": self.data.stat().st_size, "meta": meta,
                                          "xxh3_64": self._hash.hexdigest(), "tensors": self._entries}))

    def close(self) -> None:
        if not self._out.closed:
            self._out.close()


class Pack(NamedTuple):
    """A read pack file: name -> tensor (views of one buffer), the index's metadata, the buffer's
    address range, and how it is placed ("huge_pages" or "mapped": `huge_pages`)."""

    tensors: dict[str, torch.Tensor]
    meta: dict
    span: tuple[int, int]
    placement: str


def thp_setting() -> str:
    """The kernel's transparent huge page setting: "always", "madvise", "never" ("" where unknown)."""
    try:
        text = THP_SETTING.read_text()
    except OSError:
        return ""
    return text[text.index("[") + 1:text.index("]")] if "[" in text and "]" in text else ""


def huge_pages() -> bool:
    """Whether `read_pack` reads the weights into huge pages (see the module's docstring): yes where
    the kernel's THP setting is "always" or "madvise"; $KVBOOST_WEIGHTS_HUGE_PAGES=1 / 0 decides instead."""
    wanted = os.environ.get(HUGE_PAGES_ENV)
    if wanted in ("0", "1"):
        return wanted == "1"
    return hasattr(mmap, "MADV_HUGEPAGE") and thp_setting() in ("always", "madvise")


def _read_into_huge_pages(handle, size: int) -> tuple[mmap.mmap, str]:
    """The file's `size` bytes in private anonymous memory asked for in huge pages, and their xxh3
    (hashed chunk by chunk as they arrive, so the memory is walked once)."""
    buffer = mmap.mmap(-1, -(-size // HUGE_PAGE) * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer.madvise(mmap.MADV_HUGEPAGE)                  # before the first touch: its pages are made huge
    digest = xxhash.xxh3_64()
    with memoryview(buffer) as view:
        done = 0
        while done < size:
            with view[done:min(size, done + READ_CHUNK)] as chunk:
                got = handle.readinto(chunk)
                if not got:
                    raise InputError(f"{handle.name}: ended after {done} of its {size} bytes (it changed while read)")
                digest.update(chunk[:got])
            done += got
    return buffer, digest.hexdigest()


def read_pack(data: Path, index: Path, huge: bool | None = None) -> Pack:
    """The pack file `data` with its index, placed in huge pages or mapped (`huge`; None: as
    `huge_pages()` says). InputError for a file that does not match its index."""
    try:
        info = json.loads(index.read_text())
    except (OSError, ValueError) as err:
        raise InputError(f"{index}: unreadable repack index ({err})") from None
    if info.get("format") != FORMAT or data.stat().st_size != info.get("bytes"):
        raise InputError(f"{data}: not the file its index {index.name} describes (format or size differ)")
    size = info["bytes"]
    placement = "huge_pages" if (huge_pages() if huge is None else huge) and size else "mapped"
    with open(data, "rb", buffering=0) as handle:
        if placement == "huge_pages":
            try:
                buffer, digest = _read_into_huge_pages(handle, size)
            except (OSError, MemoryError) as err:               # no memory for a copy: map the file instead
                log.warning("kvboost: could not read %s into huge pages (%s); mapping it", data, err)
                placement = "mapped"
        if placement == "mapped":
            buffer = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
            digest = xxhash.xxh3_64_hexdigest(buffer) if buffer is not None else None
    if buffer is not None and digest != info.get("xxh3_64"):
        raise InputError(f"{data}: checksum differs from its index (the file changed after it was written)")
    start = ctypes.addressof(ctypes.c_char.from_buffer(buffer)) if buffer is not None else 0
    tensors = {}
    for name, entry in info["tensors"].items():
        dtype = _DTYPES[entry["dtype"]]
        count = 1
        for dim in entry["shape"]:
            count *= dim
        if count == 0:
            tensors[name] = torch.empty(entry["shape"], dtype=dtype)
            continue
        flat = torch.frombuffer(buffer, dtype=dtype, count=count, offset=entry["offset"])
        tensors[name] = flat.view(entry["shape"])
    return Pack(tensors, info["meta"], (start, start + size), placement)


def distinct_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes of the distinct tensors (a tied tensor counted once)."""
    seen, total = set(), 0
    for tensor in tensors.values():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total
