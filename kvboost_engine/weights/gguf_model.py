"""A GGUF model loaded as stored: no float copy of the model, ever.

First load (`packed_gguf_dir`): the file is checked (gguf_file.check_gguf: truncation, unknown or
unsupported types and architectures refused before anything is allocated), then every matrix is
repacked (gguf_repack.py) into the native kernel's layout and appended to a cache file one tensor
at a time (pack_file.py), with the config and tokenizer transformers reads from the GGUF, under
the kvboost cache dir. Later loads read no GGUF at all: `load_packed_model` builds the model's
skeleton with its parameters on the meta device (accelerate.init_empty_weights), then puts in
PackedLinear / PackedEmbedding modules whose tensors are views of the mapped cache file, and the
norms (float32, small) likewise. Resident weight memory is the mapped file's pages.

Conversions made on the way, each exact (row moves and one float32 subtraction): llama.cpp's
interleaved q/k rows of llama-architecture files back to HF order; Gemma 3's norms stored as
1 + w back to w. The config gets what transformers' GGUF reader drops (gguf_config): the rotary
scaling (gguf_rope.py: Llama 3.x's rope_freqs, linear, YaRN, longrope) and Gemma 3's attention scale.
"""
from __future__ import annotations

import errno
import json
import logging
import math
import os
import shutil
import time
from pathlib import Path

import torch
import xxhash
from torch import nn

from ..errors import InputError
from ..model.building import building_model
from ..paths import build_lock, cache_home, drop_superseded, made, staging_dir
from .gguf_blocks import dequantize
from .gguf_config import gguf_config, gguf_tokenizer
from .gguf_file import GGUFFile, check_gguf
from .gguf_repack import fits_packed, repack, unpermute_rows, zero_code
from .memory import available_bytes, check_fits
from .pack_file import PackWriter, mapped_bytes, read_pack
from .packed import BLOCK, TILE, PackedEmbedding, PackedLinear

PACK_VERSION = "gguf-pack-3"   # 3: K-quants keep two-level scales, Q6_K 6-bit (2: the config gets what transformers' reader drops)
DIRECT_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")     # GGUF general.architecture
NATIVE_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")   # the native step runs them as stored (decoder.py)
FLOAT_LOAD_PEAK = 2            # a GGUF dequantized to float32 peaks at about twice the float model while converting
REPACK_GROWTH = 1.4            # packed bytes / GGUF bytes at most (about 1.2: Q5_0 / Q5_K's 5-bit codes in 6 bits)
EXACT_TOP = 8                   # head rows whose logits the native step recomputes in float (as weights="int4")
DATA, INDEX, COMPLETE = "weights.bin", "weights.json", ".kvboost-complete"
EMBEDDING, HEAD = "model.embed_tokens", "lm_head"
log = logging.getLogger(__name__)


def is_packed_dir(path: Path) -> bool:
    return (path / INDEX).is_file() and (path / COMPLETE).is_file()


def stored_by_default(gguf_path: Path, native: bool = True) -> bool:
    """Whether a .gguf given without `weights` loads as stored. Never where a matrix does not fit the packed
    layout (a vocabulary of 32,002 rows, say): then as float32, the only way it loads. Yes where the native step runs the
    architecture (llama, mistral, qwen2, qwen3, gemma3: as stored is smaller and faster there) and,
    `native`, can run on this machine at all. Otherwise (any file on a CPU without the native step)
    as stored runs the PyTorch layer loop, which decodes every matrix on every forward (seconds a
    token), so it loads as float32, dequantized once, unless that copy would not fit the memory
    available: then as stored is the only way to run it. weights="gguf" / "fp32" choose."""
    file = GGUFFile(gguf_path)
    misfit = next((t for t in file.tensors.values() if len(t.shape) == 2 and not fits_packed(t.shape)), None)
    if misfit is not None:
        log.info("%s: loading as float32: %s of shape %s does not fit the packed layout (rows a multiple of %d, "
                 "columns of %d)", gguf_path.name, misfit.name, list(misfit.shape), TILE, BLOCK)
        return False
    if native and file.architecture in NATIVE_ARCHITECTURES:
        return True
    float_bytes = 4 * sum(math.prod(t.shape) for t in file.tensors.values())
    available = available_bytes()
    stored = available is not None and FLOAT_LOAD_PEAK * float_bytes > available
    why = "run this architecture" if native else "run on this machine"
    log.info("%s (%s): loading %s", gguf_path.name, file.architecture, "as stored: a float32 copy "
             f"({float_bytes / 2**30:.1f} GiB) would not fit" if stored else f"as float32 (the native step does not "
             f"{why}; weights='gguf' keeps it as stored)")
    return stored


def packed_gguf_dir(gguf_path: Path) -> Path:
    """The repacked cache dir of a .gguf (built once; keyed by path, size, mtime and the pack version:
    a cached dir is of a file checked when it was packed, so its header is not parsed again)."""
    stat = gguf_path.stat()
    ident = xxhash.xxh64_hexdigest(f"{PACK_VERSION}:{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    target = cache_home() / "packed" / f"{gguf_path.stem}-{ident}"
    if not is_packed_dir(target):
        summary = check_gguf(gguf_path)                         # refusals first, header only
        if summary.architecture not in DIRECT_ARCHITECTURES:
            raise InputError(f"GGUF architecture {summary.architecture!r} is not loaded as stored "
                             f"(direct: {', '.join(DIRECT_ARCHITECTURES)})")
        # repacked one tensor at a time: the load after it maps about this much (module docstring of gguf_repack)
        check_fits(int(summary.weight_bytes * REPACK_GROWTH), f"{gguf_path.name} repacked")
        made(target.parent)
        with build_lock(target):
            if not is_packed_dir(target):
                _build(gguf_path, target)
                for name in drop_superseded(target, gguf_path, COMPLETE):
                    log.info("removed %s, a superseded pack of %s", name, gguf_path)
    return target


def skeleton(config) -> nn.Module:
    """The model with every parameter on the meta device (buffers such as rotary tables are real)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with building_model(), init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _gguf_names(model: nn.Module, arch: str, layers: int) -> dict[str, str]:
    """HF module name -> GGUF tensor base name, for every module holding a parameter."""
    import gguf
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], layers)
    out = {}
    for name, module in model.named_modules():
        if any(True for _ in module.parameters(recurse=False)):
            found = names.get_name(name)
            if found is None:
                raise InputError(f"no GGUF tensor name for module {name} ({arch})")
            out[name] = found
    return out


def _build(gguf_path: Path, target: Path) -> None:
    started = time.perf_counter()
    file = GGUFFile(gguf_path)
    config = gguf_config(gguf_path, file)
    tokenizer = gguf_tokenizer(gguf_path)
    arch, layers = file.architecture, int(file.field(f"{file.architecture}.block_count"))
    model = skeleton(config)
    write_packed_dir(target, lambda writer: _write_tensors(model, file, arch, layers, config, writer),
                     config, tokenizer, {"gguf": str(gguf_path.resolve())})
    log.info("repacked %s into %s in %.1f s", gguf_path, target, time.perf_counter() - started)


def write_packed_dir(target: Path, write_tensors, config, tokenizer, source: dict) -> None:
    """Build a packed dir atomically: `write_tensors(writer)` appends the tensors and returns the
    index metadata (plus `source` and the time taken), then the config and tokenizer; a staging dir
    beside `target` replaces it only when complete."""
    started = time.perf_counter()
    staging = staging_dir(target.parent, ".pack-")
    aside = staging.with_name(staging.name + "-old")   # an older pack goes aside in one rename (never half deleted)
    try:
        writer = PackWriter(staging / DATA, staging / INDEX)
        try:
            meta = {"gguf": None, **write_tensors(writer), **source}
            meta["repack_s"] = round(time.perf_counter() - started, 2)
            writer.finish(meta)
        finally:
            writer.close()
        config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / COMPLETE).write_text(str(next(iter(source.values()))))
        if target.exists():
            os.replace(target, aside)
        os.replace(staging, target)
    except OSError as err:              # a full or read-only disk: which folder, and where to move the cache
        if err.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
            raise
        raise type(err)(err.errno, f"kvboost cannot write {target} ({err.strerror or err}); free space there or "
                                   "set KVBOOST_HOME to another folder") from err
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(aside, ignore_errors=True)


def _row_order(arch: str, hf_name: str, config, rows: int) -> torch.Tensor | None:
    """llama.cpp interleaves a llama file's q/k rows per head (k: per kv head); HF's order back."""
    if arch != "llama" or not hf_name.endswith(("q_proj", "k_proj")):
        return None
    heads = config.num_attention_heads if hf_name.endswith("q_proj") else config.num_key_value_heads
    return unpermute_rows(rows, heads)


def _write_tensors(model: nn.Module, file: GGUFFile, arch: str, layers: int, config, writer: PackWriter) -> dict:
    """Repack every matrix, copy every norm and bias; returns the index's metadata."""
    names = _gguf_names(model, arch, layers)         # check_gguf refused missing tensors and extra layers
    matrices, floats, worst = {}, [], {}
    for hf_name, module in model.named_modules():
        if hf_name not in names:
            continue
        base = names[hf_name]
        for pname, param in module.named_parameters(recurse=False):
            key = f"{base}.{pname}"
            if key not in file.tensors:
                if hf_name == HEAD and getattr(config, "tie_word_embeddings", False):
                    continue                                    # tied: the head reads the embedding's table
                raise InputError(f"{file.path} lacks tensor {key} (for {hf_name}.{pname})")
            tensor = file.tensors[key]
            if tuple(tensor.shape) != tuple(param.shape):       # metadata and tensors disagree (head counts...)
                raise InputError(f"{file.path}: tensor {key} is {list(tensor.shape)}, but the model its metadata "
                                 f"describes needs {list(param.shape)} for {hf_name}.{pname}")
            if param.dim() == 2:
                packed = repack(tensor, _row_order(arch, hf_name, config, tensor.shape[0]))
                for part in ("codes", "d", "m", "d2", "m2"):
                    if getattr(packed, part) is not None:
                        writer.add(f"{hf_name}.{part}", getattr(packed, part))
                matrices[hf_name] = {"bits": packed.bits, "rows": packed.rows, "cols": packed.cols,
                                     "type": tensor.type_name, "max_error": packed.max_error}
                if packed.max_error:
                    worst[tensor.type_name] = max(worst.get(tensor.type_name, 0.0), packed.max_error)
            else:
                values = dequantize(tensor).float().reshape(param.shape)
                if arch == "gemma3" and pname == "weight" and "norm" in base:
                    values = values - 1                          # stored as 1 + w (transformers does the same)
                writer.add(f"{hf_name}.{pname}", values)
                floats.append(f"{hf_name}.{pname}")
            file.release(tensor)
    if worst:
        log.warning("GGUF types without an exact kernel layout were re-quantized to 8 bits per 32 values; "
                    "largest weight error per type: %s", {k: f"{v:.3g}" for k, v in worst.items()})
    return {"matrices": matrices, "floats": floats, "requantized_error": worst,
            "tied": HEAD not in matrices}


def load_packed_model(target: Path, config) -> nn.Module:
    """The model of a repacked dir (packed_gguf_dir): weights are views of its mapped file."""
    check_fits((target / DATA).stat().st_size, f"the model in {target}")
    tensors, meta, span = read_pack(target / DATA, target / INDEX)
    model = skeleton(config)
    padding_idx = getattr(model.model.embed_tokens, "padding_idx", None)
    for name, spec in meta["matrices"].items():
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        old = getattr(owner, child)
        bias = tensors.get(f"{name}.bias")
        linear = PackedLinear(tensors[f"{name}.codes"], tensors[f"{name}.d"], tensors.get(f"{name}.m"), spec["bits"],
                              spec["rows"], spec["cols"], bias, spec.get("zero_code", zero_code(spec.get("type", ""))),
                              spec.get("m_code", 0), tensors.get(f"{name}.d2"), tensors.get(f"{name}.m2"))
        if name == EMBEDDING:
            scale = getattr(old, "embed_scale", None)
            model.model.embed_tokens = PackedEmbedding(linear, torch.float32, padding_idx, scale)
        else:
            setattr(owner, child, linear)
    if meta["tied"]:
        model.lm_head = model.model.embed_tokens.table
    model.lm_head.exact_top = EXACT_TOP
    for name in meta["floats"]:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent)
        if f"{parent}" in meta["matrices"] and child == "bias":
            continue                                            # a packed layer's bias is in the layer
        setattr(owner, child, nn.Parameter(tensors[name], requires_grad=False))
    left = [name for name, p in model.named_parameters() if p.is_meta]
    if left:
        raise InputError(f"{target}: no weights for {left[0]} ({len(left)} in all); delete the dir to repack")
    model.kvboost_mapped = [span]
    model.kvboost_packed = {"dir": str(target), "mapped_bytes": mapped_bytes(tensors), "gguf": meta.get("gguf"),
                            "requantized_error": meta.get("requantized_error", {})}
    return model.eval()


def load_packed(source: Path, device, dtype, fmt: str | None, awq_options: dict):
    """A repacked GGUF dir: quantized as stored, float32 activations on CPU."""
    import torch
    from transformers import AutoConfig

    from ..model import compat
    from ..model.arch import check_supported

    if fmt is not None or device.type != "cpu" or dtype != torch.float32:
        raise InputError(f"a GGUF loaded as stored runs on CPU with float32 activations (got weights={fmt!r}, "
                         f"{dtype} on {device.type}); pass weights='fp32' for a float model of it")
    if any(v is not None for v in awq_options.values()):
        raise InputError("layer streaming options are for AWQ checkpoints, not a GGUF")

    def opened(folder: Path):
        """(model, tokenizer) of a packed folder; InputError when its files are damaged."""
        try:            # transformers' error for a file absent or not JSON; a model type it does not know
            config = compat.fix_loaded_config(AutoConfig.from_pretrained(folder))   # (ValueError) is not damage
        except OSError as err:
            raise InputError(f"{folder}: its config.json is unreadable ({err})") from err
        check_supported(config)
        model = load_packed_model(folder, config)
        try:
            return model, compat.load_tokenizer(folder)
        except (OSError, json.JSONDecodeError) as err:      # a cut tokenizer.json failed every load
            raise InputError(f"{folder}: its tokenizer files are unreadable ({err})") from err

    try:
        return opened(source)
    except InputError as err:                   # the cache's files changed or are damaged: repack it once
        try:
            gguf_path = json.loads((source / INDEX).read_text())["meta"].get("gguf")
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            gguf_path = None                    # the index itself is damaged: it names no file to repack
        if not gguf_path or not Path(gguf_path).is_file():
            shutil.rmtree(source, ignore_errors=True)
            raise InputError(f"{err}; the repacked cache {source} could not be repaired here and is removed: "
                             "loading the .gguf again repacks it") from err
        log.warning("%s; repacking %s", err, gguf_path)
        shutil.rmtree(source, ignore_errors=True)
        return opened(packed_gguf_dir(Path(gguf_path)))
