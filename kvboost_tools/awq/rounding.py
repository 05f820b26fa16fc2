"""Error-feedback rounding (the GPTQ method, our implementation) into AWQ's per-group grid.

Round-to-nearest treats every weight on its own. Error feedback rounds the input columns of
a weight one at a time and spreads each column's rounding error over the columns not yet
rounded, weighted by the inverse of the input second-moment matrix H = E[x x^T], so the
layer's output error on the calibration inputs, not the weight error, is what is minimised.
Group scales and zero points are fixed when a group's first column is reached, from the
(already corrected) weights of that group, so the result is a plain AWQ GEMM tensor set.
"""
from __future__ import annotations

import torch

from .grid import group_grid

BLOCK = 128          # columns updated together before the lazy update of the rest


def second_moment(x: torch.Tensor) -> torch.Tensor:
    """H = x^T x / T [K, K] (float64 accumulate) of inputs x [T, K]."""
    x = x.reshape(-1, x.shape[-1]).double()
    return (x.T @ x / x.shape[0]).float()


def inverse_cholesky(h: torch.Tensor, damp: float = 0.01) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp * mean(diag H) * I)^-1; unused channels get H_kk = 1."""
    h = h.clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    h.diagonal().add_(damp * torch.diag(h).mean())
    inverse = torch.cholesky_inverse(torch.linalg.cholesky(h.double()))
    return torch.linalg.cholesky(inverse, upper=True).float()


@torch.inference_mode()
def feedback_round(weight: torch.Tensor, h: torch.Tensor, group_size: int, clip: torch.Tensor | None = None,
                   damp: float = 0.01) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round nn.Linear weight [N, K] with error feedback under H [K, K].

    Returns q [N, K/g, g] (0..15), zeros and scales [N, K/g], as format.round_groups does."""
    n, k = weight.shape
    if k % group_size or BLOCK % group_size:
        raise ValueError(f"in_features {k} and block {BLOCK} must be multiples of group size {group_size}")
    w = weight.detach().float().clone()
    dead = torch.diag(h) == 0
    w[:, dead] = 0
    u = inverse_cholesky(h, damp)                                                  # [K, K] upper
    q = torch.zeros(n, k)
    scales = torch.zeros(n, k // group_size)
    zeros = torch.zeros(n, k // group_size)
    for start in range(0, k, BLOCK):
        stop = min(start + BLOCK, k)
        errors = _round_block(w, u, start, stop, group_size, clip, q, scales, zeros)   # [N, stop-start]
        w[:, stop:] -= errors @ u[start:stop, stop:]
    return q.reshape(n, -1, group_size), zeros, scales


def _round_block(w, u, start, stop, group_size, clip, q, scales, zeros) -> torch.Tensor:
    """Round columns start..stop of w in place of q/scales/zeros; return the scaled errors."""
    block = w[:, start:stop]                                                       # view: updated in place
    errors = torch.zeros_like(block)
    for j in range(stop - start):
        col = start + j
        if col % group_size == 0:
            g = col // group_size
            scales[:, g], zeros[:, g] = group_grid(block[:, j:j + group_size],
                                                   None if clip is None else clip[:, g])
        g = col // group_size
        value = (block[:, j] / scales[:, g]).round().add(zeros[:, g]).clamp(0, 15)
        q[:, col] = value
        error = (block[:, j] - (value - zeros[:, g]) * scales[:, g]) / u[col, col]
        block[:, j:] -= error[:, None] * u[col, col:stop][None, :]
        errors[:, j] = error
    return errors
