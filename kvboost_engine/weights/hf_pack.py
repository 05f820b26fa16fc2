"""weights="int4" / "int8" from an HF float checkpoint without a float copy of the model.

The first load converts tensor by tensor: each matrix is read alone from the safetensors files
(safetensors_file.py: its pages released after), quantized (formats.py's quantizers: int4 in groups of 32 with bf16 scale and zero,
the head and embedding int8 per channel), repacked into the native kernel's layout and appended to
the cache file (pack_file.py), so the peak is the converted weights plus about one float matrix.
Later loads map that file (gguf_model.load_packed_model) and never read the float checkpoint.
The cache entry is keyed by the checkpoint files' paths, sizes and mtimes, and the format.

The numbers are those of the int4/int8 modules of formats.py (same codes and scales): the native
step computes exactly what it computed from them; the PyTorch path (prefill) now multiplies float32
activations with the exactly decoded weights instead of bfloat16 ones.

Returns None (the caller converts a loaded float model instead, weights/quantized.py) for a
checkpoint without safetensors, with tensor names other than the model's, or with matrices that do
not tile (rows a multiple of 16, columns of 32).
"""
from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import torch
import xxhash
from torch import nn

from ..errors import InputError
from ..paths import build_lock, cache_home, drop_orphans, drop_superseded, made
from .formats import INT4_GROUP, quantize_int4_groups, quantize_int8_rows
from .gguf_repack import fits_packed
from .gguf_model import COMPLETE, DATA, EMBEDDING, HEAD, is_packed_dir, load_packed_model, skeleton, write_packed_dir
from .memory import check_fits
from .pack_file import PackWriter
from .safetensors_file import SafetensorsFile
from .packed import BLOCK, pack_codes

PACK_VERSION = "hf-pack-2"        # 2: int4 m in bf16 for code 8, int8 m derived (zero_code)
BITS = {"int4": 4, "int8": 8}
log = logging.getLogger(__name__)


def _checkpoint(source: Path) -> dict[str, SafetensorsFile]:
    """tensor name -> the safetensors file holding it."""
    names = {}
    for path in sorted(source.glob("*.safetensors")):
        file = SafetensorsFile(path)
        names.update({name: file for name in file.names()})
    return names


def _tiles(module: nn.Module) -> bool:
    return fits_packed(tuple(module.weight.shape))


def _plan(model: nn.Module, stored: dict, fmt: str, config) -> dict[str, tuple] | None:
    """HF parameter name -> (kind, bits) for every parameter, or None when this path cannot take it."""
    tied = bool(getattr(config, "tie_word_embeddings", False)) and f"{HEAD}.weight" not in stored
    plan = {}
    for name, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            full = f"{name}.{pname}"
            if name == HEAD and tied:
                continue
            if full not in stored:
                return None
            if stored[full].shape(full) != tuple(param.shape):    # config and checkpoint disagree
                raise InputError(f"{stored[full].path}: tensor {full} is {list(stored[full].shape(full))}, but the "
                                 f"model config.json describes needs {list(param.shape)}")
            if pname == "weight" and isinstance(module, (nn.Linear, nn.Embedding)):
                if not _tiles(module):
                    return None
                bits = 8 if name in (HEAD, EMBEDDING) else BITS[fmt]
                plan[full] = ("matrix", bits)
            else:
                plan[full] = ("float", None)
    return plan


def _packed(weight: torch.Tensor, bits: int) -> tuple[dict, dict]:
    """(the kernel's tiles, what the index records of them): int4 keeps the quantizer's bf16 zero as
    m, the value of code 8 (m_code; 5 bits a weight, not 5.5 with a float32 offset); int8 stores m =
    -128 d (exact in bf16) for the PyTorch path, which the native step derives (zero_code)."""
    n, k = weight.shape
    if bits == 4:
        codes, scale_zeros = quantize_int4_groups(weight, INT4_GROUP)
        scale, zero = scale_zeros[..., 0].T, scale_zeros[..., 1].T               # [N, K/32] bf16 each
        return pack_codes(codes.to(torch.uint8), scale, zero, 4, torch.bfloat16, torch.bfloat16), {"m_code": 8}
    q, scales = quantize_int8_rows(weight)
    scale = scales[:, None].expand(n, k // BLOCK)
    codes = (q.to(torch.int16) + 128).to(torch.uint8)
    d = scale.to(torch.bfloat16)
    return pack_codes(codes, d, -128 * d, 8, torch.bfloat16, torch.bfloat16), {"zero_code": 128}


def _write(model, stored: dict, plan: dict, writer: PackWriter) -> dict:
    matrices, floats = {}, []
    for full, (kind, bits) in plan.items():
        tensor = stored[full].read(full)                    # float32 copy; the file's pages released
        name = full.rpartition(".")[0]
        if kind == "matrix":
            packed, codes_of = _packed(tensor, bits)
            for part in ("codes", "d", "m"):
                writer.add(f"{name}.{part}", packed[part])
            matrices[name] = {"bits": bits, "rows": tensor.shape[0], "cols": tensor.shape[1], "type": "float",
                              "max_error": 0.0, **codes_of}
        else:
            writer.add(full, tensor)
            floats.append(full)
        del tensor
    return {"matrices": matrices, "floats": floats, "requantized_error": {}, "tied": HEAD not in matrices}


def _target(source: Path, fmt: str) -> Path | None:
    files = sorted(source.glob("*.safetensors"))
    if fmt not in BITS or not files:
        return None
    ident = ":".join([PACK_VERSION, fmt, str(INT4_GROUP)] +
                     [f"{f.resolve()}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files])
    return cache_home() / "packed" / f"{source.name}-{fmt}-{xxhash.xxh64_hexdigest(ident.encode())}"


def packed_hf_dir(source: Path, fmt: str, config, tokenizer) -> Path | None:
    """The converted cache dir of an HF checkpoint in `fmt` ("int4"/"int8"), built once; None when
    this checkpoint cannot be converted tensor by tensor (module docstring)."""
    target = _target(source, fmt)
    if target is None or is_packed_dir(target):
        return target
    model = skeleton(config)
    stored = _checkpoint(source)
    plan = _plan(model, stored, fmt, config)
    if plan is None:
        return None
    params = sum(p.numel() for p in model.parameters())
    check_fits(params * (BITS[fmt] + 8) // 8, f"{source.name} in weights={fmt!r}")     # codes, d, m: an upper bound
    made(target.parent)
    with build_lock(target):
        if not is_packed_dir(target):
            _build(source, target, model, stored, plan, config, tokenizer, fmt)
            for name in drop_superseded(target, source, COMPLETE):
                log.info("removed %s, a superseded conversion of %s", name, source)
            for name in drop_orphans(target.parent, cache_home() / "models", COMPLETE):
                log.info("removed %s, a pack of a converted model that is gone", name)
    return target


def _build(source, target, model, stored, plan, config, tokenizer, fmt) -> None:
    started = time.perf_counter()
    write_packed_dir(target, lambda writer: _write(model, stored, plan, writer), config, tokenizer,
                     {"source": str(source.resolve()), "format": fmt})
    log.info("converted %s to %s in %.1f s", source, fmt, time.perf_counter() - started)


def load_hf_packed(source: Path, fmt: str | None, config, tokenizer, device, dtype) -> nn.Module | None:
    """The model of `source` in `fmt` through the packed path, or None (then convert a float model)."""
    if fmt not in BITS or device.type != "cpu" or dtype != torch.float32:
        return None
    from .quantized import WeightsInfo
    began = time.perf_counter()
    cached = (known := _target(source, fmt)) is not None and is_packed_dir(known)
    target = packed_hf_dir(source, fmt, config, tokenizer)
    if target is None:
        return None
    try:
        model = load_packed_model(target, config)
    except InputError as err:                   # the cache file changed or is damaged: convert again
        log.warning("%s; converting %s again", err, source)
        shutil.rmtree(target, ignore_errors=True)
        cached = False
        model = load_packed_model(packed_hf_dir(source, fmt, config, tokenizer), config)
    model.kvboost_packed["format"] = fmt
    model.kvboost_weights = WeightsInfo(fmt, str(target / DATA), cached, time.perf_counter() - began,
                                        model.kvboost_packed["mapped_bytes"])
    return model
