"""One GGUF matrix -> the native kernel's packed layout (weights/packed.py), exactly where the type allows.

Exact (the packed weight decodes to the `gguf` package's dequantization bit for bit):
- Q4_0, Q4_1 -> 4-bit codes, d and m in float16 (Q4_0: m = -8 d; Q4_1: the file's m)
- Q5_0, Q5_1 -> 5-bit codes 0..31 in the 6-bit layout, Q8_0 -> 8-bit codes 0..255, d and m in float16
  (m = -16 d, the file's m, -128 d)
- Q4_K -> 4-bit codes, Q5_K -> 5-bit codes in the 6-bit layout, with the two levels of scales kept:
  the 6-bit sub-block scale and minimum as uint8 d and m, the super-block's d and -dmin in float16 as
  d2 and m2 (each product, an fp16 times a 6-bit integer, is exact in float32: the file's d * sc and
  -(dmin * mn))
- Q6_K -> 6-bit codes (the kernel's 6-bit layout), its int8 scales per 16 values as d and the
  super-block's fp16 d as d2; a weight is (code - 32) * (d * d2), the reference's own expression
Each product and sum is exact in float32 (codes of at most 8 bits times an 11-bit mantissa), so
code * d + m rounds to the same float as the reference's expression. An m that is -zero * d
(`zero_code`: Q4_0, Q5_0, Q8_0, Q6_K, re-quantized) is not stored: it is derived from d, exactly.

Converted once, with the error stated (`Repacked.max_error`): float matrices (F32/F16/BF16),
re-quantized to 8 bits per 32 values (symmetric, round to nearest: at most 1/254 of the block's
largest magnitude).

`row_order`: the file's rows in another order (llama.cpp stores llama's q/k rows interleaved per head;
`unpermute_rows` gives HF's order), applied to codes and scales alike: a row move is exact.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import UnsupportedModelError
from .gguf_blocks import GGUFTensor, blocks, dequantize
from .packed import BLOCK, TILE, pack_codes, tile_scales

_HALF = {"Q4_0": (4, 8), "Q4_1": (4, None), "Q5_0": (6, 16), "Q5_1": (6, None), "Q8_0": (8, 128)}
_K = {"Q4_K": 4, "Q5_K": 6}                # 5-bit codes in the kernel's 6-bit layout
SIX_BIT = "Q6_K"
REQUANTIZED = ("F32", "F16", "BF16")


def zero_code(kind: str) -> int | None:
    """The code whose value is 0 where a packed matrix of this GGUF type has m == -code * d exactly
    (Q4_0 8, Q5_0 16, Q6_K 32, Q8_0 and the re-quantized types 128), else None (the file's own m)."""
    if kind in REQUANTIZED:
        return 128
    if kind == SIX_BIT:
        return 32
    return _HALF.get(kind, (None, None))[1]


@dataclass(slots=True)
class Repacked:
    """A matrix in the packed layout: tensors for PackedLinear, and how far it is from the file."""

    codes: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None      # None: derived from d (zero_code)
    bits: int
    rows: int
    cols: int
    max_error: float            # largest |packed - file| over the matrix (0.0: exact)
    d2: torch.Tensor | None = None      # K-quants: float16 super-block scales of uint8 d and m
    m2: torch.Tensor | None = None


def unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """Row order undoing llama.cpp's q/k permutation for `heads` heads (HF's reverse_permute)."""
    dim = rows // heads // 2
    return torch.arange(rows).view(heads, dim, 2).transpose(1, 2).reshape(rows)


def _half_exact(values: torch.Tensor) -> bool:
    return torch.equal(values.half().float(), values)


def _scale_dtypes(d: torch.Tensor, m: torch.Tensor) -> tuple[torch.dtype, torch.dtype]:
    if _half_exact(d):
        return torch.float16, torch.float16 if _half_exact(m) else torch.float32
    return torch.float32, torch.float32


def _requantized(values: torch.Tensor) -> tuple:
    """float [N, K] -> 8-bit codes, d, m per block of 32 (symmetric), and the largest error."""
    n, k = values.shape
    v = values.view(n, k // BLOCK, BLOCK)
    d = (v.abs().amax(dim=-1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    codes = (torch.round(v / d[..., None]).clamp(-127, 127) + 128).to(torch.uint8)
    m = -128 * d
    error = (torch.addcmul(m[..., None], codes.float(), d[..., None]) - v).abs().max()
    return codes.view(n, k), d, m, float(error)


def fits_packed(shape) -> bool:
    """Whether a matrix of `shape` [N, K] fits the packed layout: N a multiple of 16, K of 32."""
    return len(shape) == 2 and shape[0] % TILE == 0 and shape[1] % BLOCK == 0


def repack(tensor: GGUFTensor, row_order: torch.Tensor | None = None) -> Repacked:
    """A GGUF matrix [N, K] (N a multiple of 16, K of 32) in the packed layout (module docstring)."""
    if not fits_packed(tensor.shape):
        raise UnsupportedModelError(f"tensor {tensor.name} of shape {list(tensor.shape)} does not fit the packed "
                                    f"layout (a matrix with rows a multiple of {TILE}, columns of {BLOCK}); "
                                    "weights='fp32' loads the file as float32")
    n, k = tensor.shape
    kind = tensor.type_name
    error = 0.0
    if kind in _K or kind == SIX_BIT:
        return _two_level(tensor, row_order)
    if kind in _HALF:
        q = blocks(tensor)
        codes, d = q.codes, q.scales
        bits, zero = _HALF[kind]
        if kind == "Q8_0":
            codes = (codes.to(torch.int16) + 128).to(torch.uint8)
        m = q.mins if zero is None else -zero * d
        d_dtype, m_dtype = _scale_dtypes(d, m)
    elif kind in REQUANTIZED:
        values = dequantize(tensor).float()
        codes, d, m, error = _requantized(values)
        bits, d_dtype, m_dtype = 8, torch.float32, torch.float32
    else:
        raise UnsupportedModelError(f"type {kind} of tensor {tensor.name} has no packed layout "
                                    f"(supported: {', '.join([*_HALF, *_K, SIX_BIT, *REQUANTIZED])})")
    if zero_code(kind) is not None:
        m = None                                # -zero * d: derived where it is used, never stored
    if row_order is not None:
        codes, d = codes[row_order], d[row_order]
        m = None if m is None else m[row_order]
    packed = pack_codes(codes.reshape(n, k).to(torch.uint8), d, m, bits, d_dtype, m_dtype)
    return Repacked(packed["codes"], packed["d"], packed["m"], bits, n, k, error)


def _two_level(tensor: GGUFTensor, row_order: torch.Tensor | None) -> Repacked:
    """A K-quant with its scales as stored: Q4_K / Q5_K's uint8 sub-block scales and minimums with
    float16 super-block d and -dmin, Q6_K's int8 scales per 16 with its float16 d (module docstring;
    the fp16 values came from fp16, so the cast is exact)."""
    n, k = tensor.shape
    q = blocks(tensor)
    six = tensor.type_name == SIX_BIT
    parts = [q.codes.reshape(n, k), *q.factors]
    if row_order is not None:
        parts = [t[row_order] for t in parts]
    if six:
        codes, sc, d = parts
        packed = pack_codes(codes.to(torch.uint8), sc, None, 6, torch.int8)
        return Repacked(packed["codes"], packed["d"], None, 6, n, k, 0.0, tile_scales(d, torch.float16))
    codes, sc, d, mn, dmin = parts
    bits = _K[tensor.type_name]
    packed = pack_codes(codes.to(torch.uint8), sc, mn, bits, torch.uint8, torch.uint8)
    return Repacked(packed["codes"], packed["d"], packed["m"], bits, n, k, 0.0,
                    tile_scales(d, torch.float16), tile_scales(-dmin, torch.float16))
