"""Blend's selection of moved tokens to recompute after the check layer."""
import math

import torch

from kvboost_engine.request.blend import Selector


def test_keeps_new_tokens_heads_and_the_most_deviating_moved_tokens():
    #            new  new  head  moved moved moved moved moved moved moved  new
    moved = torch.tensor([0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0], dtype=torch.bool)
    head = torch.tensor([0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0], dtype=torch.bool)
    deviation = torch.tensor([9., 9., 0., 1., 7., 2., 8., 3., 0.5, 6., 9.])
    selector = Selector(moved, head, ratio=0.375, layer=1)        # budget ceil(0.375 * 8) = 3 moved tokens
    keep = selector.keep(deviation).tolist()
    assert keep == [0, 1, 2, 4, 6, 10]         # new tokens, the head, then the two largest deviations (8, 7)
    assert selector.recomputed_moved == 3
    assert keep == sorted(keep)


def test_ratio_zero_keeps_only_new_tokens_and_heads_ratio_one_keeps_all():
    moved = torch.tensor([1, 1, 1, 1, 0], dtype=torch.bool)
    head = torch.tensor([1, 0, 0, 0, 0], dtype=torch.bool)
    deviation = torch.rand(5)
    assert Selector(moved, head, 0.0, 1).keep(deviation).tolist() == [0, 4]
    everything = Selector(moved, head, 1.0, 1)
    assert everything.keep(deviation).tolist() == [0, 1, 2, 3, 4] and everything.recomputed_moved == 4


def test_budget_counts_heads_first():
    moved = torch.ones(20, dtype=torch.bool)
    head = torch.zeros(20, dtype=torch.bool)
    head[:4] = True
    selector = Selector(moved, head, 0.15, 1)
    keep = selector.keep(torch.arange(20.))
    assert selector.recomputed_moved == max(4, math.ceil(0.15 * 20))
    assert keep.tolist() == [0, 1, 2, 3]
