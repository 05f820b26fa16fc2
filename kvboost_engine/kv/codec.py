"""Optional int8 storage of cached KV chunks on disk: per-channel keys, per-token values.

Keys vary mostly by channel (a few channels carry large values), values by token, so keys get
one scale per (layer, head, channel) over the chunk's tokens and values one scale per (layer,
head, token) over channels. Symmetric int8, scale = max |x| / 127. An fp32 chunk shrinks to
about a quarter (plus scales). Chunks read back this way are approximations: the cache marks
them inexact, so telemetry never reports them as exact reuse.
"""
from __future__ import annotations

import torch

from .geometry import KVGeometry


class Int8Codec:
    """kv [2, layers, kv_heads, n, head_dim] <-> one flat uint8 tensor (int8 data, then fp32 scales)."""

    exact = False

    def __init__(self, geometry: KVGeometry):
        self.geometry = geometry

    def encode(self, kv: torch.Tensor) -> torch.Tensor:
        keys, values = kv[0].float(), kv[1].float()                               # [L, H, n, D]
        k_scale = keys.abs().amax(dim=2, keepdim=True).clamp_min(1e-12) / 127     # [L, H, 1, D]
        v_scale = values.abs().amax(dim=3, keepdim=True).clamp_min(1e-12) / 127   # [L, H, n, 1]
        k_q = torch.round(keys / k_scale).to(torch.int8)
        v_q = torch.round(values / v_scale).to(torch.int8)
        parts = [k_q.flatten().view(torch.uint8), v_q.flatten().view(torch.uint8),
                 k_scale.flatten().view(torch.uint8), v_scale.flatten().view(torch.uint8)]
        return torch.cat(parts)

    def decode(self, data: torch.Tensor, tokens: int) -> torch.Tensor:
        g = self.geometry
        shape = (g.num_layers, g.kv_heads, tokens, g.head_dim)
        count = g.num_layers * g.kv_heads * tokens * g.head_dim
        k_scale_n = g.num_layers * g.kv_heads * g.head_dim
        cut = [count, count, 4 * k_scale_n, 4 * g.num_layers * g.kv_heads * tokens]
        k_q, v_q, k_s, v_s = torch.split(data, cut)
        keys = k_q.view(torch.int8).view(shape).float() * k_s.view(torch.float32).view(g.num_layers, g.kv_heads, 1, g.head_dim)
        values = v_q.view(torch.int8).view(shape).float() * v_s.view(torch.float32).view(g.num_layers, g.kv_heads, tokens, 1)
        return torch.stack([keys, values]).to(g.dtype)


class FloatCodec:
    """Chunks stored as they are (the default)."""

    exact = True

    def encode(self, kv: torch.Tensor) -> torch.Tensor:
        return kv

    def decode(self, data: torch.Tensor, tokens: int) -> torch.Tensor:
        return data
