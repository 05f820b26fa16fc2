"""KV buffers on transparent huge pages (kv/hugepages.py): ordinary tensors, 2 MB-aligned where
Linux offers MADV_HUGEPAGE, torch.empty otherwise."""
from __future__ import annotations

import gc

import pytest
import torch

from kvboost_engine.kv import hugepages
from kvboost_engine.kv.geometry import KVGeometry
from kvboost_engine.kv.pool import BlockPool


@pytest.mark.skipif(not hugepages.available(), reason="no MADV_HUGEPAGE here")
def test_a_large_buffer_is_aligned_to_a_huge_page_and_outlives_its_name():
    t = hugepages.empty((3, 1 << 20), torch.float32)
    assert t.shape == (3, 1 << 20) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % hugepages.HUGE == 0
    gc.collect()
    t.fill_(2.0)
    assert t.sum().item() == 6 * (1 << 20)
    view = t[1:]
    del t
    gc.collect()
    view.add_(1.0)                          # the mapping lives while any view of it does
    assert view[0, 0].item() == 3.0


def test_small_buffers_and_the_switch_take_torch_empty(monkeypatch):
    small = hugepages.empty((4, 8), torch.float16)
    assert small.shape == (4, 8) and small.dtype == torch.float16
    monkeypatch.setenv(hugepages.ENV, "0")
    assert not hugepages.available()
    big = hugepages.empty((1 << 20, 4), torch.float32)
    assert big.shape == (1 << 20, 4)


def test_the_pool_keeps_its_numbers_on_huge_pages():
    g = KVGeometry(num_layers=2, kv_heads=2, head_dim=64, dtype=torch.float32)
    pool = BlockPool(g, 8 << 20, torch.device("cpu"))
    assert pool.ram.is_contiguous() and pool.ram.dtype == torch.float32
    pool.ram.normal_()
    copy = pool.ram.clone()
    gc.collect()
    assert torch.equal(pool.ram, copy)
