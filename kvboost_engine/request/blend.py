"""Repairing moved KV: which moved tokens to recompute, and the forward that does it.

"deviation" (CacheBlend): at the check layer every moved token is computed fresh; tokens whose
fresh K/V deviate most from the re-rotated cached K/V (their meaning depended most on the text
that used to precede them) are kept for the remaining layers, together with the first tokens of
each moved span and all new tokens. Everything else keeps its cached KV from then on.
"attention" (ProphetKV-style): a probe pass of the new tokens over the moved KV picks the moved
tokens they attend to most; those and the new tokens are recomputed.
"none": moved tokens keep their re-rotated KV; only new tokens are computed.
"""
from __future__ import annotations

import math

import torch

from ..kv.tree import KVSpan


class Selector:
    """Picks the active tokens to keep after the check layer."""

    def __init__(self, moved: torch.Tensor, head: torch.Tensor, ratio: float, layer: int):
        # moved/head: bool [A] over the initial active tokens (new tokens: moved False)
        self.moved = moved
        self.head = head
        self.ratio = ratio
        self.layer = layer
        self.recomputed_moved = int(moved.sum())

    def keep(self, deviation: torch.Tensor) -> torch.Tensor:
        """Indices (ascending) of active tokens to keep, given per-token deviation [A]."""
        budget = math.ceil(self.ratio * int(self.moved.sum()))
        forced = ~self.moved | self.head
        candidates = self.moved & ~self.head
        extra = max(0, budget - int((self.moved & self.head).sum()))
        chosen = forced.clone()
        if extra and candidates.any():
            scores = torch.where(candidates, deviation.float().cpu(), torch.tensor(float("-inf")))
            top = torch.topk(scores, min(extra, int(candidates.sum()))).indices
            chosen[top] = True
        self.recomputed_moved = int((chosen & self.moved).sum())
        return torch.nonzero(chosen).flatten()


def repair_moved(runner, config, num_layers: int, prompt, kv, prefix_len: int,
                 moved: list[KVSpan]) -> tuple[torch.Tensor, int]:
    """Compute new tokens (and the selected moved tokens) over `kv`. Returns (logits, moved tokens recomputed)."""
    n = len(prompt)
    is_moved = torch.zeros(n, dtype=torch.bool)
    is_head = torch.zeros(n, dtype=torch.bool)
    for span in moved:
        is_moved[span.start:span.start + span.length] = True
        is_head[span.start:span.start + config.recompute_head_tokens] = True
    positions = torch.arange(prefix_len, n)
    if config.moved_reuse == "none":
        positions = positions[~is_moved[prefix_len:]]
        return runner.scattered(kv, prompt.token_ids, positions, n), 0
    layer = min(config.check_layer, num_layers - 1)
    selector = Selector(is_moved[positions], is_head[positions], config.recompute_ratio, layer)
    if config.moved_selection == "attention":
        new = positions[~is_moved[positions]]
        mass = runner.attention_mass(kv, prompt.token_ids, new, n, selector.layer + 1)       # [n]
        keep = selector.keep(mass[positions])
        return runner.scattered(kv, prompt.token_ids, positions[keep], n), selector.recomputed_moved
    logits = runner.scattered(kv, prompt.token_ids, positions, n, selector)
    return logits, selector.recomputed_moved
