"""`weights=`: convert a loaded float model's weights to a fast CPU format, cached on disk.

Formats (weights/formats.py): "fp32" (or None: the weights as loaded, exact), "bf16", "int8"
(per-channel, weight-only) and "int4" (groups of 32; the head and embedding as int8, which costs
far less perplexity than int4 there). Every linear layer of the decoder layers and the output
head is replaced; the embedding reads the same converted matrix as a tied head. Norms, biases,
the residual stream and the KV stay in the model's dtype.

The converted tensors are written once to a safetensors file under the kvboost cache dir, keyed
by the model fingerprint, the format, the PyTorch version and CPU capability (the int4 pack
layout depends on both); a later load with the same option reads that file instead of
converting again.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import xxhash
from torch import nn

from ..errors import InputError
from ..model.arch import ModelAdapter, decoder_layers
from ..model.fingerprint import model_fingerprint
from ..paths import build_folder, build_lock, cache_home
from .formats import (INT4_GROUP, Bf16Linear, FormatEmbedding, Int4Linear, Int8Linear, int4_supported, pack_int4,
                      quantize_int4_groups, quantize_int8_rows)
from .memory import release_free_memory

WEIGHT_FORMATS = ("fp32", "bf16", "int8", "int4")
HEAD, EMBEDDING = "lm_head", "model.embed_tokens"
EXACT_TOP = 8                   # head outputs per position recomputed in float32 (formats.py)
CACHE_FORMAT = "kvboost-weights-1"
log = logging.getLogger(__name__)


@dataclass(slots=True)
class WeightsInfo:
    """What `weights=` did at load time (reported in Engine.stats() as weights_*)."""

    weights_format: str
    weights_cache_file: str
    weights_from_cache: bool         # True: read the converted file; False: converted now (and wrote it)
    weights_convert_s: float
    weights_bytes: int               # bytes of every weight the model now holds (converted and float)

    def as_dict(self) -> dict:
        return asdict(self)


def check_weights_format(weights, dtype: torch.dtype, device: torch.device) -> str | None:
    """The format to convert to (None: keep the weights as loaded); InputError for a bad value."""
    if weights == "gguf":
        if device.type != "cpu" or dtype != torch.float32:
            raise InputError(f"weights='gguf' (a GGUF's quantized tensors as stored) runs on CPU in float32 "
                             f"activations; got {dtype} on {device.type}")
        return None
    if weights is None or weights == "fp32":
        if weights == "fp32" and dtype != torch.float32:
            raise InputError(f"weights='fp32' keeps float32 weights but dtype is {dtype}; leave weights unset")
        return None
    if weights not in WEIGHT_FORMATS:
        raise InputError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, 'gguf' or None, got {weights!r}")
    if device.type != "cpu":
        raise InputError(f"weights={weights!r} is a CPU format (its kernels run on CPU); on {device.type} use dtype=")
    if dtype not in (torch.float32, torch.bfloat16):
        raise InputError(f"weights={weights!r} needs dtype float32 or bfloat16, got {dtype}")
    return weights


def convert_model(model: nn.Module, fmt: str, cache_dir: Path | None = None) -> WeightsInfo:
    """Replace the model's linear layers (and embedding) by `fmt` modules, in place."""
    began = time.perf_counter()
    targets = _targets(model)
    path = Path(cache_dir or cache_home() / "weights") / f"{_cache_key(model, fmt)}.safetensors"
    stored = _read_cache(path, targets, fmt)
    from_cache = stored is not None
    if stored is None:
        try:
            with build_lock(path):
                stored = _read_cache(path, targets, fmt)
                from_cache = stored is not None
                if stored is None:
                    stored = _convert_all(targets, fmt)
                    _write_cache(path, stored, fmt)
        except OSError as err:          # a full disk, a read-only cache: the conversion serves, uncached
            log.warning("cannot keep the converted weights in %s (%s): converted for this process only", path, err)
            stored = stored or _convert_all(targets, fmt)
    _install(model, targets, stored)
    release_free_memory(collect=True)
    info = WeightsInfo(fmt, str(path), from_cache, time.perf_counter() - began, _weight_bytes(model))
    model.kvboost_weights = info
    return info


def _convert_all(targets: dict[str, nn.Module], fmt: str) -> dict:
    return {name: _convert(module.weight, _format_of(name, fmt)) for name, module in targets.items()}


def _targets(model: nn.Module) -> dict[str, nn.Module]:
    """The modules to convert by name: every nn.Linear of the decoder layers, the head, and the
    embedding unless it is tied to the head (then it reads the head's converted matrix)."""
    out = {}
    for i, layer in enumerate(decoder_layers(model)):
        for name, module in layer.named_modules():
            if isinstance(module, nn.Linear):
                out[f"model.layers.{i}.{name}"] = module
    out[HEAD] = model.lm_head
    if model.lm_head.weight is not model.model.embed_tokens.weight:
        out[EMBEDDING] = model.model.embed_tokens
    return out


def _format_of(name: str, fmt: str) -> str:
    """int4 keeps the head and embedding in int8: an int4 head costs ~5% perplexity (int8: 0.25%)."""
    return "int8" if fmt == "int4" and name in (HEAD, EMBEDDING) else fmt


def _convert(weight: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    if fmt == "bf16":
        return {"weight": weight.detach().to(torch.bfloat16).contiguous()}
    n, k = weight.shape
    if fmt == "int4" and int4_supported(n, k, INT4_GROUP):
        codes, scale_zeros = quantize_int4_groups(weight, INT4_GROUP)
        packed, block = pack_int4(codes)
        return {"packed": packed, "scale_zeros": scale_zeros, "block": torch.tensor([block], dtype=torch.int32)}
    qweight, scales = quantize_int8_rows(weight)            # int8, or int4's fallback for odd shapes
    return {"qweight": qweight, "scales": scales}


def _module(tensors: dict[str, torch.Tensor], bias) -> nn.Module:
    if "weight" in tensors:
        return Bf16Linear(tensors["weight"], bias)
    if "packed" in tensors:
        return Int4Linear(tensors["packed"], tensors["scale_zeros"], INT4_GROUP, int(tensors["block"][0]), bias)
    return Int8Linear(tensors["qweight"], tensors["scales"], bias)


def _install(model: nn.Module, targets: dict[str, nn.Module], stored: dict) -> None:
    dtype = ModelAdapter(model).dtype
    padding_idx = model.model.embed_tokens.padding_idx
    for name, module in targets.items():
        if name == EMBEDDING:
            continue
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, child, _module(stored[name], module.bias))
    model.lm_head.exact_top = EXACT_TOP
    rows = stored.get(EMBEDDING, stored[HEAD])                  # a tied embedding shares the head's tensors
    weight, scales = rows.get("weight", rows.get("qweight")), rows.get("scales")
    model.model.embed_tokens = FormatEmbedding(weight, scales, dtype, padding_idx)


def _cache_key(model: nn.Module, fmt: str) -> str:
    fingerprint = model_fingerprint(model, ModelAdapter(model).rope_settings())
    parts = [CACHE_FORMAT, fmt, fingerprint.hex(), torch.__version__, torch.backends.cpu.get_cpu_capability(),
             str(INT4_GROUP)]
    return f"{fmt}-{xxhash.xxh3_64_hexdigest(':'.join(parts).encode())}"


def _read_cache(path: Path, targets: dict[str, nn.Module], fmt: str) -> dict | None:
    """The converted tensors by module, or None when the file is missing or does not fit the model."""
    if not path.exists():
        return None
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file
    try:
        flat = load_file(str(path))
        with safe_open(str(path), "pt") as handle:
            recorded = (handle.metadata() or {}).get("xxh3_64")
    except (OSError, SafetensorError) as err:
        log.warning("ignoring unreadable converted-weights file %s (%s): converting again", path, err)
        return None
    if recorded is not None and recorded != _digest(flat):      # files from before the checksum: shapes only
        log.warning("converted-weights file %s differs from its checksum (changed on disk): converting again", path)
        return None
    stored = {}
    for name, module in targets.items():
        tensors = {key.rpartition(".")[2]: value for key, value in flat.items() if key.rpartition(".")[0] == name}
        if not _fits(tensors, module, _format_of(name, fmt)):
            log.warning("converted-weights file %s does not match the model at %s: converting again", path, name)
            return None
        # fresh (aligned) memory: file-backed tensors sit at any byte offset, and the int8 kernel
        # crashes on a misaligned weight (torch 2.13)
        stored[name] = {key: value.clone() for key, value in tensors.items()}
    return stored


def _fits(tensors: dict, module: nn.Module, fmt: str) -> bool:
    n, k = module.weight.shape
    if "weight" in tensors:
        return fmt == "bf16" and tuple(tensors["weight"].shape) == (n, k)
    if "packed" in tensors:
        return fmt == "int4" and tuple(tensors["scale_zeros"].shape) == (k // INT4_GROUP, n, 2) and "block" in tensors
    return fmt in ("int8", "int4") and "qweight" in tensors and tuple(tensors["qweight"].shape) == (n, k)


def _write_cache(path: Path, stored: dict, fmt: str) -> None:
    """The converted tensors to `path` (in one rename); an OSError when they cannot be written."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file
    flat = {f"{name}.{key}": value.contiguous() for name, tensors in stored.items() for key, value in tensors.items()}
    handle, staging = tempfile.mkstemp(prefix=".convert-", suffix=".safetensors", dir=build_folder(path.parent))
    os.close(handle)
    try:
        save_file(flat, staging, metadata={"format": CACHE_FORMAT, "weights": fmt, "xxh3_64": _digest(flat),
                                           "modules": json.dumps(sorted(stored))})
        os.chmod(staging, 0o644)                # not mkstemp's 0600: others sharing the cache read it
        os.replace(staging, path)
    except SafetensorError as err:      # a full disk (safetensors' own error)
        raise OSError(str(err)) from err
    finally:
        if os.path.exists(staging):
            os.remove(staging)


def _digest(flat: dict[str, torch.Tensor]) -> str:
    """xxh3_64 over the tensors' names and bytes, in name order."""
    digest = xxhash.xxh3_64()
    for name in sorted(flat):
        digest.update(name.encode())
        digest.update(flat[name].contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def _weight_bytes(model: nn.Module) -> int:
    seen, total = set(), 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        total += tensor.numel() * tensor.element_size()
    return total
