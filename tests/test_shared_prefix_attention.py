"""Cascade attention over a shared prefix equals each sequence's own attention (paged KV)."""
import pytest
import torch

from kvboost_engine.kv.geometry import KVGeometry
from kvboost_engine.kv.paged import SHARED_MIN_TOKENS, PagedSequence
from kvboost_engine.kv.pool import BlockPool

BLOCK = 16
GEOMETRY = KVGeometry(num_layers=2, kv_heads=2, head_dim=8, dtype=torch.float32)


def sequences(shared_blocks: int, own_tokens: list[int], order=None):
    pool = BlockPool(GEOMETRY, 64 * BLOCK * GEOMETRY.bytes_per_token, "cpu", block_tokens=BLOCK)
    torch.manual_seed(0)
    pool.ram.normal_()
    prefix = pool.allocate(shared_blocks)
    if order is not None:                                   # the shared blocks scattered over the pool
        prefix = [prefix[i] for i in order]
    seqs, ends = [], []
    for own in own_tokens:
        end = shared_blocks * BLOCK + own
        seq = PagedSequence(pool, end)
        pool.retain(prefix)
        seq.map_shared(prefix)
        seq.reserve()
        seqs.append(seq)
        ends.append(end)
    return seqs, ends


# 4 blocks: one short run, gathered; 12 blocks: a run of 9 in place (>= SHARED_RUN_MIN_TOKENS),
# then blocks out of order (short runs, gathered); 16 blocks: two long runs, both in place.
LAYOUTS = [(4, None, [], 64), (12, [0, 1, 2, 3, 4, 5, 6, 7, 8, 11, 9, 10], [144], 48),
           (16, [8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7], [128, 128], 0)]


@pytest.mark.parametrize("own_tokens", [[1, 5, 17], [3, 3], [40, 1, 2, 33]])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_shared_prefix_attention_writes_the_new_kv_and_matches_each_sequence_alone(own_tokens, layout):
    blocks, order, in_place, gathered = layout
    seqs, ends = sequences(blocks, own_tokens, order)
    shared = seqs[0].shared_prefix(seqs, ends)
    assert shared == blocks * BLOCK
    scratch = {}
    for layer in range(GEOMETRY.num_layers):
        query = torch.randn(1, 4, len(seqs), 8)                          # 4 heads over 2 KV heads
        keys, values = torch.randn(1, 2, len(seqs), 8), torch.randn(1, 2, len(seqs), 8)
        together = seqs[0].attend_shared(seqs, ends, layer, query, keys, values, 0.35, shared, scratch)
        for row, (seq, end) in enumerate(zip(seqs, ends)):
            k, v = seq.gather(layer, torch.tensor([end - 1]))
            assert torch.equal(k[0, :, 0], keys[0, :, row]) and torch.equal(v[0, :, 0], values[0, :, row])
            alone = seq.attend(layer, query[:, :, row:row + 1], None, False, 0.35, end, lambda: None)
            torch.testing.assert_close(together[:, :, row:row + 1], alone, rtol=1e-5, atol=1e-6)
    assert [n for _, n in scratch["runs"]] == in_place
    assert (0 if scratch["gathered"] is None else len(scratch["gathered"])) == gathered


def test_no_shared_prefix_below_the_minimum_or_across_different_blocks():
    seqs, ends = sequences(1, [4, 4])
    assert BLOCK < SHARED_MIN_TOKENS and seqs[0].shared_prefix(seqs, ends) == 0
    a, a_ends = sequences(4, [2])
    b, b_ends = sequences(4, [2])                                         # another pool's blocks 0..3
    b[0].table = [t + 10 for t in b[0].table]
    assert a[0].shared_prefix(a + b, a_ends + b_ends) == 0


def test_sequences_with_blocks_in_the_disk_spill_are_not_grouped(monkeypatch):
    seqs, ends = sequences(4, [2, 3])
    monkeypatch.setattr(PagedSequence, "_scatter_ok", lambda self: self is not seqs[1])
    assert seqs[0].shared_prefix(seqs, ends) == 0
