"""Rounding weights to AWQ's 4-bit grid (asymmetric, per group) and packing them: the quantizer's side of the format."""
from __future__ import annotations

import torch

from kvboost_engine.weights.awq.format import pack_int4


def quantize_groups(weight: torch.Tensor, group_size: int, clip: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit round-to-nearest of an nn.Linear weight [N, K] per group of K.

    `clip` [N, K/g] (optional) shrinks each group's range by that factor before rounding.
    Returns AWQ tensors (qweight int32 [K, N/8], qzeros int32 [K/g, N/8], scales fp16 [K/g, N]).
    """
    return pack_groups(*round_groups(weight, group_size, clip))


def pack_groups(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AWQ tensors from q [N, K/g, g] (0..15), zeros and scales [N, K/g] (nn.Linear orientation)."""
    n_out = q.shape[0]
    qweight = pack_int4(q.reshape(n_out, -1).T.contiguous())
    return qweight, pack_int4(zeros.T.contiguous()), scales.T.contiguous().half()


def fake_quantize(weight: torch.Tensor, group_size: int, clip: torch.Tensor | None = None) -> torch.Tensor:
    """weight [N, K] after the 4-bit round trip of `quantize_groups` (no packing)."""
    q, zeros, scales = round_groups(weight, group_size, clip)
    return ((q - zeros[..., None]) * scales[..., None]).reshape(weight.shape)


def round_groups(weight: torch.Tensor, group_size: int, clip: torch.Tensor | None = None):
    """q [N, K/g, g], zeros and scales [N, K/g]; scales rounded to fp16 first, so the
    checkpoint's fp16 scales reproduce the rounding exactly."""
    n_out, n_in = weight.shape
    if n_in % group_size:
        raise ValueError(f"in_features {n_in} is not a multiple of group size {group_size}")
    w = weight.detach().float().reshape(n_out, n_in // group_size, group_size)  # [N, K/g, g]
    scales, zeros = group_grid(w, clip)
    q = (w / scales[..., None]).round().add(zeros[..., None]).clamp(0, 15)       # [N, K/g, g]
    return q, zeros, scales


def group_grid(w: torch.Tensor, clip: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales (fp16-exact) and zero points [...] of weight groups w [..., g]: the 16 levels span
    the group's range (widened to include 0), shrunk by `clip` [...] when given."""
    w_max = w.amax(dim=-1).clamp(min=0)
    w_min = w.amin(dim=-1).clamp(max=0)
    if clip is not None:
        w_max, w_min = w_max * clip, w_min * clip
    scales = ((w_max - w_min).clamp(min=1e-5) / 15).half().float()
    zeros = (-w_min / scales).round().clamp(0, 15)
    return scales, zeros
