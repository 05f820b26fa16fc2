"""Moving cached keys to new positions (RoPE re-rotation), exactly.

A key cached at position p_old was rotated by angles a_old = fl32(p_old * inv_freq). The same
key at p_new would carry a_new = fl32(p_new * inv_freq). We rotate the cached key by
(a_new - a_old), computed in float64 from those very fp32 angles, so the result matches what
the model's own rotary embedding gives at p_new (to fp32 rounding), and every move starts
from the stored key (one rotation, no accumulated error). Attention scaling factors (yarn,
longrope) multiply both and are left as they are. Partial rotary (Phi-3) rotates only the
first `rotary_dim` dimensions.

Models whose layers use different RoPE settings (Gemma 3: sliding-window layers with a local
base, global layers with their own) move each layer's keys with that layer's own frequencies.

Rope types whose frequencies depend on the sequence length (dynamic NTK, longrope) are exact
only while every position stays within the original window; beyond it `can_move` says no and
the caller recomputes instead.
"""
from __future__ import annotations

import torch

from .arch import ModelAdapter

EXACT_TYPES = ("default", "linear", "llama3", "yarn")
LENGTH_DEPENDENT_TYPES = ("dynamic", "longrope")


class KindRotation:
    """Re-rotation for the layers sharing one set of RoPE frequencies."""

    def __init__(self, inv_freq: torch.Tensor, params: dict, config, context_window: int):
        self.rope_type = params.get("rope_type", "default")
        self.inv_freq = inv_freq.detach().float().cpu()          # [rotary_dim / 2]
        self.rotary_dim = 2 * self.inv_freq.shape[0]
        self.exact_limit = None
        if self.rope_type in LENGTH_DEPENDENT_TYPES:
            self.exact_limit = int(params.get("original_max_position_embeddings")
                                   or getattr(config, "original_max_position_embeddings", 0)
                                   or context_window)
        self.supported = self.rope_type in EXACT_TYPES + LENGTH_DEPENDENT_TYPES

    def can_move(self, highest_position: int) -> bool:
        if not self.supported:
            return False
        return self.exact_limit is None or highest_position < self.exact_limit

    def rotation(self, old_positions: torch.Tensor, new_positions: torch.Tensor):
        """cos/sin [n, rotary_dim] (fp32) taking keys from old to new positions."""
        old = (old_positions.float()[:, None] * self.inv_freq).double()
        new = (new_positions.float()[:, None] * self.inv_freq).double()
        delta = torch.cat([new - old] * 2, dim=-1)
        return delta.cos().float(), delta.sin().float()

    def rotate(self, keys: torch.Tensor, old_start: int, new_start: int) -> torch.Tensor:
        """Keys [..., n, head_dim] cached at old_start.. as they would be at new_start.. (a new tensor)."""
        n = keys.shape[-2]
        cos, sin = self.rotation(torch.arange(old_start, old_start + n), torch.arange(new_start, new_start + n))
        part = keys[..., :self.rotary_dim].float()
        rotated = part * cos.to(keys.device) + _rotate_half(part) * sin.to(keys.device)
        return torch.cat([rotated.to(keys.dtype), keys[..., self.rotary_dim:]], dim=-1)


class RopeMover:
    """Moves cached keys of every layer to new positions, each layer with its own frequencies."""

    def __init__(self, adapter: ModelAdapter):
        self.layer_kinds = adapter.layer_rope_kinds
        self.kinds = {kind: KindRotation(inv_freq, params, adapter.config, adapter.context_window)
                      for kind, (inv_freq, params) in adapter.rope_kinds().items()}
        # layer indices of each kind, for models whose layers differ
        self.layers_of = {kind: [i for i, k in enumerate(self.layer_kinds) if k == kind] for kind in self.kinds}

    @property
    def per_layer(self) -> bool:
        """Whether layers use different frequencies (then `move` needs keys of every layer)."""
        return len(self.kinds) > 1

    @property
    def exact_limit(self) -> int | None:
        """Positions from which some layer's keys can no longer be moved exactly (None: no limit)."""
        limits = [kind.exact_limit for kind in self.kinds.values() if kind.exact_limit is not None]
        return min(limits) if limits else None

    def can_move(self, highest_position: int) -> bool:
        """Whether keys up to `highest_position` can be moved exactly in every layer (else: recompute)."""
        return all(kind.can_move(highest_position) for kind in self.kinds.values())

    def move(self, keys: torch.Tensor, old_start: int, new_start: int) -> torch.Tensor:
        """Rotate keys cached at old_start.. to new_start.., in place, and return them.

        keys: [layers, kv_heads, n, head_dim]; on a model with one RoPE for all layers any
        leading shape [..., n, head_dim] works.
        """
        if old_start == new_start:
            return keys
        if not self.per_layer:
            (kind,) = self.kinds.values()
            keys.copy_(kind.rotate(keys, old_start, new_start))
            return keys
        if keys.shape[0] != len(self.layer_kinds):
            raise ValueError(f"keys must be [layers={len(self.layer_kinds)}, kv_heads, n, head_dim] on a model "
                             f"whose layers use different RoPE settings; got {tuple(keys.shape)}")
        for name, kind in self.kinds.items():
            index = torch.tensor(self.layers_of[name], device=keys.device)
            keys[index] = kind.rotate(keys[index], old_start, new_start)
        return keys


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
