"""Our attention function, registered with transformers' AttentionInterface.

HF attention modules project, normalise and rotate q/k/v, then call the registered function.
Ours writes the new K/V into the request's buffer and attends over everything up to the
current position.

Called without our step (someone else using the same model object: a plain `model(...)` or
`model.generate`), it behaves exactly like the attention implementation the model had before
we switched it: the implementation name we set is `kvboost_<original>`, under which the
original's attention function is called and the original's mask function is registered (with a
name transformers does not know, it would build no masks at all, and sliding windows would be
lost on plain calls).
"""
from __future__ import annotations

import re
import sys

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

ATTENTION_NAME = "kvboost"
_SIMPLE_NAME = re.compile(r"^[A-Za-z0-9_]+$")


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
        # several queries with no window that cuts keys: causal from the last key, which the KV's dense
        # attention may compute without the mask (kv/dense.py); the mask stays for what cannot
        is_causal = query.shape[2] > 1 and (window is None or window >= self.end)
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
    sequence's rows write its own KV and attend over its own KV only (its AttentionStep).

    Decoding sequences (one query each, no window in the layer) whose paged KV starts with the
    same pool blocks, such as chats over one system prompt, attend over those blocks once for all
    of them (the KV's `shared_prefix` / `attend_shared`, paged KV only): a decode step then reads
    the shared KV once, not once per sequence."""

    __slots__ = ("steps", "rows", "device", "_groups")

    def __init__(self, steps: list[AttentionStep], rows: list[tuple[int, int]]):
        self.steps = steps
        self.rows = rows                                # [lo, hi) of each sequence's tokens
        self.device = steps[0].device
        self._groups: dict = {}         # window -> [(member indices, shared positions, scratch of the group)]

    def attend(self, layer: int, query, keys, values, scaling: float) -> torch.Tensor:
        # query [1, H, T, D]; keys/values [1, Hkv, T, D] -> output [1, T, H, D]
        outs = [None] * len(self.steps)
        for members, shared, scratch in self._shared_groups(self.steps[0].layer_windows[layer]):
            rows = [self.rows[i][0] for i in members]
            if rows == list(range(rows[0], rows[0] + len(rows))):          # one token each, side by side
                def stacked(tensor, lo=rows[0], hi=rows[0] + len(rows)):
                    return tensor[:, :, lo:hi]
            else:
                def stacked(tensor, rows=rows):
                    return torch.cat([tensor[:, :, r:r + 1] for r in rows], dim=2)
            out = self.steps[members[0]].kv.attend_shared(
                [self.steps[i].kv for i in members], [self.steps[i].end for i in members], layer,
                stacked(query), stacked(keys), stacked(values), scaling, shared, scratch)     # [1, H, M, D]
            if len(members) == len(self.steps) and rows[0] == 0:
                return out.transpose(1, 2)                                      # everyone, in order
            for j, i in enumerate(members):
                outs[i] = out[:, :, j:j + 1].transpose(1, 2)
        for i, (step, (lo, hi)) in enumerate(zip(self.steps, self.rows)):
            if outs[i] is None:
                outs[i] = step.attend(layer, query[:, :, lo:hi], keys[:, :, lo:hi], values[:, :, lo:hi], scaling)
        return torch.cat(outs, dim=1)

    def _shared_groups(self, window) -> list:
        """Groups of decoding sequences that share leading pool blocks, for layers of this window."""
        if window not in self._groups:
            by_first: dict = {}
            for i, (step, (lo, hi)) in enumerate(zip(self.steps, self.rows)):
                table = getattr(step.kv, "table", None) if hasattr(step.kv, "attend_shared") else None
                if hi - lo == 1 and table and table[0] is not None and step.masks[window] is None:
                    by_first.setdefault(table[0], []).append(i)
            groups = []
            for members in by_first.values():
                if len(members) > 1:
                    kvs = [self.steps[i].kv for i in members]
                    shared = kvs[0].shared_prefix(kvs, [self.steps[i].end for i in members])
                    if shared:
                        groups.append((members, shared, {}))
            self._groups[window] = groups
        return self._groups[window]


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


def kvboost_name(original: str | None) -> str:
    """The implementation name that routes a model to our attention and keeps `original` for plain calls.

    Registers it (with transformers' attention and mask interfaces) on first use. Originals that
    are not plain registered names (hub kernels) fall back to SDPA for plain calls.
    """
    if original is not None and original.startswith(ATTENTION_NAME):
        return original
    if original is None or not _SIMPLE_NAME.match(original) or (
            original != "eager" and original not in ALL_ATTENTION_FUNCTIONS):
        original = "sdpa"
    name = f"{ATTENTION_NAME}_{original}"
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, kvboost_attention)
    if original in ALL_MASK_ATTENTION_FUNCTIONS and name not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[original])
    return name


def original_attention(name: str) -> str:
    """The implementation a model had before `kvboost_name` switched it (plain calls use it)."""
    original = name.removeprefix(ATTENTION_NAME).removeprefix("_")
    return original or "sdpa"


def plain_attention(module, query, key, value, attention_mask, **kwargs):
    """A call without our step: exactly what the model's original implementation does."""
    original = original_attention(module.config._attn_implementation)
    if original != "eager" and original in ALL_ATTENTION_FUNCTIONS:
        function = ALL_ATTENTION_FUNCTIONS[original]
    else:                                   # the modeling file's own eager function (softcap etc.)
        function = getattr(sys.modules[type(module).__module__], "eager_attention_forward", sdpa_attention_forward)
    return function(module, query, key, value, attention_mask, **kwargs)


def kvboost_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    step = kwargs.pop("kvboost_step", None)
    if step is None:
        return plain_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if query.device != step.device:         # KV pages elsewhere (kv_device="cpu"): attend there
        out = step.attend(module.layer_idx, query.to(step.device), key.to(step.device), value.to(step.device),
                          scaling)
        return out.to(query.device), None
    return step.attend(module.layer_idx, query, key, value, scaling), None


AttentionInterface.register(ATTENTION_NAME, kvboost_attention)
AttentionMaskInterface.register(ATTENTION_NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
