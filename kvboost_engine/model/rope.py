"""Moving cached keys to new positions (RoPE re-rotation), exactly.

A key cached at position p_old was rotated by angles a_old = fl32(p_old * inv_freq). The same
key at p_new would carry a_new = fl32(p_new * inv_freq). We rotate the cached key by
(a_new - a_old), computed in float64 from those very fp32 angles, so the result matches what
the model's own rotary embedding gives at p_new (to fp32 rounding), and every move starts
from the stored key (one rotation, no accumulated error). Attention scaling factors (yarn,
longrope) multiply both and are left as they are. Partial rotary (Phi-3) rotates only the
first `rotary_dim` dimensions.

Rope types whose frequencies depend on the sequence length (dynamic NTK, longrope) are exact
only while every position stays within the original window; beyond it `can_move` says no and
the caller recomputes instead.
"""
from __future__ import annotations

import torch

from .arch import ModelAdapter

EXACT_TYPES = ("default", "linear", "llama3", "yarn")
LENGTH_DEPENDENT_TYPES = ("dynamic", "longrope")


class RopeMover:
    def __init__(self, adapter: ModelAdapter):
        rotary = adapter.rotary
        params = adapter.rope_settings()
        self.rope_type = params.get("rope_type", "default")
        source = getattr(rotary, "original_inv_freq", None)
        if source is None:
            source = rotary.inv_freq
        self.inv_freq = source.detach().float().cpu()          # [rotary_dim / 2]
        self.rotary_dim = 2 * self.inv_freq.shape[0]
        self.exact_limit = None
        if self.rope_type in LENGTH_DEPENDENT_TYPES:
            self.exact_limit = int(params.get("original_max_position_embeddings")
                                   or getattr(adapter.config, "original_max_position_embeddings", 0)
                                   or adapter.context_window)
        self.supported = self.rope_type in EXACT_TYPES + LENGTH_DEPENDENT_TYPES

    def can_move(self, highest_position: int) -> bool:
        """Whether keys up to `highest_position` can be moved exactly (else: recompute)."""
        if not self.supported:
            return False
        return self.exact_limit is None or highest_position < self.exact_limit

    def rotation(self, old_positions: torch.Tensor, new_positions: torch.Tensor):
        """cos/sin [n, rotary_dim] (fp32) taking keys from old to new positions."""
        old = (old_positions.float()[:, None] * self.inv_freq).double()
        new = (new_positions.float()[:, None] * self.inv_freq).double()
        delta = torch.cat([new - old] * 2, dim=-1)
        return delta.cos().float(), delta.sin().float()

    def move(self, keys: torch.Tensor, old_start: int, new_start: int) -> torch.Tensor:
        """Rotate keys [..., n, head_dim] cached at old_start.. to new_start.., in place."""
        if old_start == new_start:
            return keys
        n = keys.shape[-2]
        cos, sin = self.rotation(torch.arange(old_start, old_start + n), torch.arange(new_start, new_start + n))
        part = keys[..., :self.rotary_dim]
        rotated = part.float() * cos.to(keys.device) + _rotate_half(part.float()) * sin.to(keys.device)
        part.copy_(rotated.to(keys.dtype))
        return keys


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
