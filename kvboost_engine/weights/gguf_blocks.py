"""A GGUF file's tensors as stored: integer codes and float32 scales, never a float copy of the model.

Reading and checking the file is gguf_file.py's job; here `blocks` decodes one quantized tensor into codes + scales
(+ minimums); `dequantize` turns one tensor into float32 exactly as `gguf.quants.dequantize` does
(same operations in the same order, so the results are equal bit for bit).

Block layouts (32 values a block for the legacy types, 256 for the K-quants; GGUF lists a 2-D
tensor's dims as [columns, rows], the PyTorch shape here is [rows, columns]):

- Q4_0: fp16 d, 16 bytes of nibbles (low nibbles are values 0-15, high 16-31); v = (q - 8) * d
- Q4_1: fp16 d, fp16 m, 16 bytes of nibbles; v = q * d + m
- Q5_0 / Q5_1: as Q4_0 / Q4_1 with 4 bytes of fifth bits (bit i: value i's) before the nibbles;
  v = (q - 16) * d / q * d + m (llama.cpp's fallback for K-quant files whose rows are not 256 wide)
- Q8_0: fp16 d, 32 int8; v = q * d
- Q4_K: fp16 d, fp16 dmin, 12 bytes of 6-bit scales/mins for 8 groups of 32, 128 bytes of nibbles;
  v = (d * sc) * q - (dmin * mn); Q5_K adds 32 bytes of fifth bits after the scales
- Q6_K: 128 bytes low nibbles, 64 bytes high 2-bit pairs, 16 int8 scales (groups of 16), fp16 d;
  v = (d * sc) * (q - 32)

fp16 -> fp32 is exact, and so are d * sc and dmin * mn (11-bit mantissa times a 6- or 8-bit
integer), so the scales given here are the very numbers the reference multiplies with.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import InputError, UnsupportedModelError

# types `blocks`/`dequantize` reproduce exactly; the rest are named in a refusal
FLOAT_TYPES = ("F32", "F16", "BF16")
QUANT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
EXACT_TYPES = FLOAT_TYPES + QUANT_TYPES
QK = 32                 # values a block of the legacy types


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """One tensor of a GGUF file, as stored (`raw` is memory-mapped, not copied)."""

    name: str
    type_name: str              # "Q4_1", "F32", ...
    shape: tuple[int, ...]      # PyTorch order: [rows, columns] for a matrix
    nbytes: int                 # bytes it occupies in the file
    raw: np.ndarray             # uint8 blocks for a quantized type, the values for a float type


@dataclass(frozen=True, slots=True)
class QuantBlocks:
    """A quantized tensor decoded: value = (codes - zero_code) * scales (+ mins), per group.

    codes: uint8 [*shape] (Q8_0: int8); scales and mins: float32 [rows, columns / group]."""

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None   # Q4_1: added; Q4_K, Q5_K: subtracted (see `dequantize`); else None
    zero_code: int              # Q4_0: 8, Q6_K: 32, else 0
    group: int                  # values sharing one scale: 32 (Q6_K: 16)
    # Q4_K, Q5_K: the factors of scales and mins as stored, (sc, d, mn, dmin): 6-bit sub-block
    # scales and minimums uint8 [rows, groups], their super-block's d and dmin float32 [rows, groups / 8];
    # scales = d * sc and mins = dmin * mn per group (exact products). Q6_K: (sc, d), int8 scales per 16
    # [rows, groups] and d [rows, groups / 16]. Else None.
    factors: tuple | None = None


def _fp16(raw: np.ndarray, start: int) -> torch.Tensor:
    """The fp16 at byte `start` of every block [..., bytes] as float32 [...] (exact)."""
    half = np.ascontiguousarray(raw[..., start:start + 2]).view(np.float16)[..., 0]
    return torch.from_numpy(half.astype(np.float32))


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32] codes: the low nibbles are values 0-15, the high ones 16-31."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def _blocks_view(tensor: GGUFTensor, block_bytes: int) -> torch.Tensor:
    """The tensor's bytes as uint8 [rows, blocks a row, block_bytes] (a view of the mapping)."""
    rows = int(np.prod(tensor.shape[:-1])) if len(tensor.shape) > 1 else 1
    return torch.from_numpy(tensor.raw).view(rows, -1, block_bytes)


def _legacy_blocks(tensor: GGUFTensor) -> QuantBlocks:
    kind = tensor.type_name
    head = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6, "Q5_1": 8, "Q8_0": 2}[kind]
    block_bytes = head + (QK if kind == "Q8_0" else QK // 2)
    b = _blocks_view(tensor, block_bytes)                                   # [R, B, bytes]
    raw = b.numpy()
    scales = _fp16(raw, 0)                                                  # [R, B]
    if kind == "Q8_0":
        codes = b[..., head:].contiguous().view(torch.int8)                 # [R, B, 32]
    else:
        codes = _nibbles(b[..., head:])
    if kind in ("Q5_0", "Q5_1"):
        qh = b[..., head - 4:head].contiguous().view(torch.int32)           # [R, B, 1] little-endian
        codes = codes | (((qh >> torch.arange(QK, dtype=torch.int32)) & 1) << 4).to(torch.uint8)
    mins = _fp16(raw, 2) if kind in ("Q4_1", "Q5_1") else None
    zero = {"Q4_0": 8, "Q5_0": 16}.get(kind, 0)
    return QuantBlocks(codes.reshape(tensor.shape), scales, mins, zero, QK)


def _q4k_scale_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 bytes [..., 12] -> 6-bit scales and mins [..., 8] (llama.cpp's get_scale_min_k4)."""
    d, m, m_d = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _q45k_blocks(tensor: GGUFTensor) -> QuantBlocks:
    """Q4_K, and Q5_K (its fifth bits: bit j of 32 bytes is group j's, between the scales and nibbles)."""
    five = tensor.type_name == "Q5_K"
    b = _blocks_view(tensor, 176 if five else 144)                          # [R, B, bytes]
    raw = b.numpy()
    d, dmin = _fp16(raw, 0)[..., None], _fp16(raw, 2)[..., None]            # [R, B, 1]
    sc, mn = _q4k_scale_mins(b[..., 4:16])                                  # [R, B, 8]
    qs = b[..., 48 if five else 16:].reshape(*b.shape[:2], 4, 32)           # 4 x 32 bytes: 2 groups each
    codes = torch.stack([qs & 15, qs >> 4], dim=-2).flatten(2, 3)           # [R, B, 8, 32]
    if five:
        qh = b[..., 16:48]                                                  # [R, B, 32]
        codes = codes | torch.stack([((qh >> j) & 1) << 4 for j in range(8)], dim=-2)
    scales = (d * sc.float()).flatten(1)                                    # [R, B * 8]
    mins = (dmin * mn.float()).flatten(1)
    factors = (sc.flatten(1), d[..., 0], mn.flatten(1), dmin[..., 0])
    return QuantBlocks(codes.reshape(tensor.shape), scales, mins, 0, QK, factors)


def _q6k_blocks(tensor: GGUFTensor) -> QuantBlocks:
    b = _blocks_view(tensor, 210)                                           # [R, B, 210]
    rows, nb = b.shape[:2]
    ql = b[..., :128].reshape(rows, nb, 2, 1, 64)
    qh = b[..., 128:192].reshape(rows, nb, 2, 1, 32)
    low = torch.cat([ql & 15, ql >> 4], dim=3).reshape(rows, nb, 8, 32)     # [R, B, 8, 32]
    high = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=3).reshape(rows, nb, 8, 32)
    codes = low | (high << 4)                                               # 0..63
    sc = b[..., 192:208].contiguous().view(torch.int8)                      # [R, B, 16]
    d = _fp16(b.numpy(), 208)[..., None]
    return QuantBlocks(codes.reshape(tensor.shape), (d * sc.float()).flatten(1), None, 32, 16,
                       (sc.flatten(1), d[..., 0]))


def blocks(tensor: GGUFTensor) -> QuantBlocks:
    """The codes and float32 scales (and minimums) of a quantized tensor, exactly as stored."""
    if tensor.type_name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        return _legacy_blocks(tensor)
    if tensor.type_name in ("Q4_K", "Q5_K"):
        return _q45k_blocks(tensor)
    if tensor.type_name == "Q6_K":
        return _q6k_blocks(tensor)
    raise UnsupportedModelError(f"type {tensor.type_name} of tensor {tensor.name} has no exact repack yet "
                                f"(exact: {', '.join(QUANT_TYPES)})")


def dequantize(tensor: GGUFTensor) -> torch.Tensor:
    """The tensor as float32 [*shape], bit for bit what `gguf.quants.dequantize` returns."""
    kind = tensor.type_name
    if kind == "F32":
        return torch.from_numpy(np.ascontiguousarray(tensor.raw).view(np.float32)).reshape(tensor.shape)
    if kind == "F16":
        return torch.from_numpy(tensor.raw.view(np.float16).astype(np.float32)).reshape(tensor.shape)
    if kind == "BF16":
        bits = torch.from_numpy(np.ascontiguousarray(tensor.raw).view(np.int16)).to(torch.int32) << 16
        return bits.view(torch.float32).reshape(tensor.shape)
    q = blocks(tensor)
    rows = q.scales.shape[0]
    codes = q.codes.reshape(rows, -1, q.group)                              # [R, G, group]
    scales, mins = q.scales[..., None], None if q.mins is None else q.mins[..., None]
    if kind in ("Q4_0", "Q5_0"):
        out = scales * (codes.to(torch.int8) - q.zero_code).float()
    elif kind in ("Q4_1", "Q5_1"):
        out = scales * codes.float() + mins
    elif kind == "Q8_0":
        out = codes.float() * scales
    elif kind in ("Q4_K", "Q5_K"):
        out = scales * codes.float() - mins
    else:                                                                   # Q6_K
        out = scales * (codes.to(torch.int8) - 32).float()
    return out.reshape(tensor.shape)

