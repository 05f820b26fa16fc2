"""Our attention function, registered with transformers' AttentionInterface.

HF attention modules project, normalise and rotate q/k/v, then call the registered function.
Ours writes the new K/V into the request's buffer and attends over everything up to the
current position. Called without our step (someone else using the same model object) it
falls back to transformers' SDPA, so the model keeps working as a plain HF model.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .kv import SequenceKV

ATTENTION_NAME = "kvboost"


class AttentionStep:
    """One forward over new tokens at positions start..end, reading KV of 0..end."""

    __slots__ = ("kv", "start", "end", "masks", "layer_windows")

    def __init__(self, kv: SequenceKV, start: int, end: int, layer_windows: tuple):
        self.kv = kv
        self.start = start
        self.end = end
        self.layer_windows = layer_windows
        self.masks = {w: causal_mask(start, end, w, kv.data.device) for w in set(layer_windows)}

    def attend(self, layer: int, query, keys, values, scaling: float) -> torch.Tensor:
        # query [1, H, N, D]; keys/values [1, Hkv, N, D] -> output [1, N, H, D]
        self.kv.write(layer, keys, values, self.start)
        all_keys, all_values = self.kv.view(layer, self.end)
        mask = self.masks[self.layer_windows[layer]]
        is_causal = mask is None and self.start == 0 and query.shape[2] > 1
        out = F.scaled_dot_product_attention(
            query, all_keys, all_values, attn_mask=mask, is_causal=is_causal,
            scale=scaling, enable_gqa=query.shape[1] != all_keys.shape[1],
        )
        return out.transpose(1, 2)


class ScatterStep:
    """One forward over active tokens at arbitrary positions (moved-reuse repair).

    Fresh K/V of the active tokens overwrite the buffer at their positions; every query sees
    all keys up to its own position (cached, re-rotated or fresh). With `measure`, the
    per-token deviation of fresh from cached K/V is recorded before overwriting.
    """

    __slots__ = ("kv", "positions", "end", "masks", "layer_windows", "measure", "deviation")

    def __init__(self, kv: SequenceKV, positions: torch.Tensor, end: int, layer_windows: tuple, measure: bool):
        self.kv = kv
        self.positions = positions                      # [A] ascending absolute positions
        self.end = end
        self.layer_windows = layer_windows
        self.measure = measure
        self.deviation = None
        k_pos = torch.arange(end, device=positions.device)[None, :]
        q_pos = positions[:, None]
        self.masks = {}
        for w in set(layer_windows):
            mask = k_pos <= q_pos
            if w is not None:
                mask &= k_pos > q_pos - w
            self.masks[w] = mask

    def attend(self, layer: int, query, keys, values, scaling: float) -> torch.Tensor:
        # query [1, H, A, D]; keys/values [1, Hkv, A, D] -> output [1, A, H, D]
        cached_k = self.kv.data[0, layer, :, :, self.positions]
        cached_v = self.kv.data[1, layer, :, :, self.positions]
        if self.measure:
            self.deviation = ((keys - cached_k) ** 2).sum((0, 1, 3)) + ((values - cached_v) ** 2).sum((0, 1, 3))
        self.kv.data[0, layer, :, :, self.positions] = keys
        self.kv.data[1, layer, :, :, self.positions] = values
        all_keys, all_values = self.kv.view(layer, self.end)
        out = F.scaled_dot_product_attention(
            query, all_keys, all_values, attn_mask=self.masks[self.layer_windows[layer]],
            scale=scaling, enable_gqa=query.shape[1] != all_keys.shape[1],
        )
        return out.transpose(1, 2)


def causal_mask(start: int, end: int, window: int | None, device) -> torch.Tensor | None:
    """Bool mask [N, end] (True = attend) for queries at start..end, or None when not needed.

    None means: a single query over all keys, or a full causal square (SDPA's is_causal).
    With a sliding window a key is visible when query_pos - window < key_pos <= query_pos.
    """
    n = end - start
    if window is None or window >= end:
        if n == 1 or start == 0:
            return None
    q_pos = torch.arange(start, end, device=device)[:, None]
    k_pos = torch.arange(end, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


def kvboost_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    step = kwargs.pop("kvboost_step", None)
    if step is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    return step.attend(module.layer_idx, query, key, value, scaling), None


AttentionInterface.register(ATTENTION_NAME, kvboost_attention)
