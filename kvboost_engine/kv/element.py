"""How one KV row (head_dim values of one token, layer and KV head) is stored (EngineConfig.kv_dtype).

float32 / float16 / bfloat16: the values as they are, rounded to nearest even on write. int8: the
row's values in blocks of 32, each block int8 codes with one float16 scale (llama.cpp's q8_0 numbers,
8.5 bits a value): d = fp16(max |x| / 127), code = round-half-even(x / d) clamped to +-127, read back
as code * d (an exact product in float32). A stored int8 row is head_dim codes, then head_dim / 32
scales (2 bytes each), in one int8 tensor of row_width() elements. The native step reads and writes
the same bytes with the same arithmetic (native/decode.cpp kv_put / kv_vec), so both paths see the
same KV.
"""
from __future__ import annotations

import torch

INT8_BLOCK = 32                     # values per int8 scale
_F16_MAX = 65504.0


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of `dtype` per stored row of head_dim values."""
    return head_dim + head_dim // INT8_BLOCK * 2 if dtype == torch.int8 else head_dim


def value_dtype(dtype: torch.dtype) -> torch.dtype:
    """The float type rows stored as `dtype` are read back in where no other is asked (int8: float32)."""
    return torch.float32 if dtype == torch.int8 else dtype


def unsupported(head_dim: int, dtype: torch.dtype) -> str | None:
    """Why rows of head_dim values cannot be stored as `dtype` (None: they can)."""
    if dtype == torch.int8 and head_dim % INT8_BLOCK:
        return f"kv_dtype='int8' needs a head_dim that is a multiple of {INT8_BLOCK} (this model's is {head_dim})"
    return None


def store(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float rows [..., head_dim] as stored rows [..., row_width] of `dtype`."""
    if dtype != torch.int8:
        return x.to(dtype)
    blocks = x.float().unflatten(-1, (-1, INT8_BLOCK))                          # [..., B, 32]
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    d = (amax / 127).clamp_max(_F16_MAX).to(torch.float16)                      # [..., B, 1]
    df = d.float()
    codes = torch.round(blocks / torch.where(df > 0, df, 1.0)).clamp_(-127, 127).to(torch.int8)
    scales = d.view(torch.int8)                                                 # [..., B, 2]
    return torch.cat([codes.flatten(-2), scales.flatten(-2)], dim=-1)


def load(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stored rows [..., row_width] as float rows [..., head_dim] of `dtype`."""
    if t.dtype != torch.int8:
        return t.to(dtype)
    head_dim = t.shape[-1] * INT8_BLOCK // (INT8_BLOCK + 2)
    codes = t[..., :head_dim].float().unflatten(-1, (-1, INT8_BLOCK))          # [..., B, 32]
    scales = t[..., head_dim:].contiguous().view(torch.float16).float()          # [..., B]
    return (codes * scales[..., None]).flatten(-2).to(dtype)
