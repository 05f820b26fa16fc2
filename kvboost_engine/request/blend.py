"""Which moved tokens to recompute: CacheBlend-style selection by KV deviation.

At the check layer every moved token is computed fresh; tokens whose fresh K/V deviate most
from the re-rotated cached K/V (their meaning depended most on the text that used to precede
them) are kept for the remaining layers, together with the first tokens of each moved span
and all new tokens. Everything else keeps its cached KV from then on.
"""
from __future__ import annotations

import math

import torch


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
