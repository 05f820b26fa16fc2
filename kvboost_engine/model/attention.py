"""Our attention function, registered with transformers' AttentionInterface.

HF attention modules project, normalise and rotate q/k/v, then call the registered function.
Ours writes the new K/V into the request's buffer and attends over everything up to the
current position. Called without our step (someone else using the same model object) it
falls back to transformers' SDPA, so the model keeps working as a plain HF model.
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

ATTENTION_NAME = "kvboost"


class AttentionStep:
    """One forward over new tokens at positions start..end, reading KV of 0..end."""

    __slots__ = ("kv", "device", "start", "end", "masks", "layer_windows", "_explicit")

    def __init__(self, kv, start: int, end: int, layer_windows: tuple):
        self.kv = kv
        self.device = kv.device
        self.start = start
        self.end = end
        self.layer_windows = layer_windows
        self.masks = {w: causal_mask(start, end, w, kv.device) for w in set(layer_windows)}
        self._explicit = {}

    def attend(self, layer: int, query, keys, values, scaling: float) -> torch.Tensor:
        # query [1, H, N, D]; keys/values [1, Hkv, N, D] -> output [1, N, H, D]
        self.kv.write(layer, keys, values, self.start)
        window = self.layer_windows[layer]
        mask = self.masks[window]
        is_causal = mask is None and self.start == 0 and query.shape[2] > 1
        out = self.kv.attend(layer, query, mask, is_causal, scaling, self.end, lambda: self._full_mask(window),
                             (self.start, self.end - 1), window)
        return out.transpose(1, 2)

    def _full_mask(self, window):
        """The mask with nothing implied (for attention split into runs)."""
        if window not in self._explicit:
            mask = self.masks[window]
            if mask is None and self.end - self.start > 1:
                mask = explicit_mask(torch.arange(self.start, self.end, device=self.device), self.end, window)
            self._explicit[window] = mask
        return self._explicit[window]


class BatchStep:
    """One forward over the new tokens of several sequences packed along the token axis: each
    sequence's rows write its own KV and attend over its own KV only (its AttentionStep)."""

    __slots__ = ("steps", "rows", "device")

    def __init__(self, steps: list[AttentionStep], rows: list[tuple[int, int]]):
        self.steps = steps
        self.rows = rows                                # [lo, hi) of each sequence's tokens
        self.device = steps[0].device

    def attend(self, layer: int, query, keys, values, scaling: float) -> torch.Tensor:
        # query [1, H, T, D]; keys/values [1, Hkv, T, D] -> output [1, T, H, D]
        return torch.cat([step.attend(layer, query[:, :, lo:hi], keys[:, :, lo:hi], values[:, :, lo:hi], scaling)
                          for step, (lo, hi) in zip(self.steps, self.rows)], dim=1)


class ScatterStep:
    """One forward over active tokens at arbitrary positions (moved-reuse repair).

    Fresh K/V of the active tokens overwrite the sequence's KV at their positions; every query
    sees all keys up to its own position (cached, re-rotated or fresh). Queries are attended in
    pieces of QUERY_PIECE, each over keys up to its last position, so mask memory stays bounded.
    With `measure`, the per-token deviation of fresh from cached K/V is recorded first.
    """

    QUERY_PIECE = 1024
    __slots__ = ("kv", "device", "positions", "end", "layer_windows", "measure", "deviation", "_masks")

    def __init__(self, kv, positions: torch.Tensor, end: int, layer_windows: tuple, measure: bool,
                 masks: dict | None = None):
        self.kv = kv
        self.device = kv.device
        self.positions = positions                      # [A] ascending absolute positions
        self.end = end
        self.layer_windows = layer_windows
        self.measure = measure
        self.deviation = None
        self._masks = {} if masks is None else masks    # shared by the layers of one forward

    def attend(self, layer: int, query, keys, values, scaling: float) -> torch.Tensor:
        # query [1, H, A, D]; keys/values [1, Hkv, A, D] -> output [1, A, H, D]
        if self.measure:
            cached_k, cached_v = self.kv.gather(layer, self.positions)
            self.deviation = ((keys - cached_k) ** 2).sum((0, 1, 3)) + ((values - cached_v) ** 2).sum((0, 1, 3))
        self.kv.write_at(layer, keys, values, self.positions)
        window = self.layer_windows[layer]
        outs = []
        for lo in range(0, len(self.positions), self.QUERY_PIECE):
            piece = self.positions[lo:lo + self.QUERY_PIECE]
            first, last = int(piece[0]), int(piece[-1])
            mask = self._mask(lo, piece, window)
            outs.append(self.kv.attend(layer, query[:, :, lo:lo + self.QUERY_PIECE], mask, False, scaling,
                                       last + 1, lambda m=mask: m, (first, last), window))
        return torch.cat(outs, dim=2).transpose(1, 2)

    def _mask(self, lo: int, piece: torch.Tensor, window):
        key = (lo, len(piece), int(piece[0]), window)
        if key not in self._masks:
            self._masks[key] = explicit_mask(piece.to(self.device), int(piece[-1]) + 1, window)
        return self._masks[key]


class ProbeStep(ScatterStep):
    """A ScatterStep that also adds up the attention its queries pay to every key position:
    `mass` [end] (summed over heads and queries, each layer normalised to 1 per query)."""

    __slots__ = ("mass",)

    def __init__(self, kv, positions: torch.Tensor, end: int, layer_windows: tuple, mass: torch.Tensor,
                 masks: dict | None = None):
        super().__init__(kv, positions, end, layer_windows, False, masks)
        self.mass = mass

    def attend(self, layer: int, query, keys, values, scaling: float) -> torch.Tensor:
        out = super().attend(layer, query, keys, values, scaling)
        all_keys, _ = self.kv.gather(layer, torch.arange(self.end, device=self.device))   # [1, Hkv, end, D]
        all_keys = all_keys.repeat_interleave(query.shape[1] // all_keys.shape[1], 1)
        scores = (query.float() @ all_keys.float().transpose(-1, -2)) * scaling          # [1, H, A, end]
        visible = explicit_mask(self.positions.to(self.device), self.end, self.layer_windows[layer])
        weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        self.mass += weights.sum((0, 1, 2)).to(self.mass.device) / query.shape[2]
        return out


def explicit_mask(q_positions: torch.Tensor, end: int, window: int | None) -> torch.Tensor:
    """Bool [A, end]: query at position q sees keys k with q - window < k <= q."""
    k_pos = torch.arange(end, device=q_positions.device)[None, :]
    q_pos = q_positions[:, None]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


def causal_mask(start: int, end: int, window: int | None, device) -> torch.Tensor | None:
    """Bool mask [N, end] (True = attend) for queries at start..end, or None when not needed.

    None means: a single query over all keys, or a full causal square (SDPA's is_causal).
    """
    if (window is None or window >= end) and (end - start == 1 or start == 0):
        return None
    return explicit_mask(torch.arange(start, end, device=device), end, window)


def kvboost_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    step = kwargs.pop("kvboost_step", None)
    if step is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if query.device != step.device:         # KV pages elsewhere (kv_device="cpu"): attend there
        out = step.attend(module.layer_idx, query.to(step.device), key.to(step.device), value.to(step.device),
                          scaling)
        return out.to(query.device), None
    return step.attend(module.layer_idx, query, key, value, scaling), None


AttentionInterface.register(ATTENTION_NAME, kvboost_attention)
