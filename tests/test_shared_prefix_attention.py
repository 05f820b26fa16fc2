"""Cascade attention over a shared prefix equals each sequence's own attention (paged KV)."""
import pytest
import torch

from kvboost_engine.kv.geometry import KVGeometry
from kvboost_engine.kv.paged import SHARED_MIN_TOKENS, PagedSequence
from kvboost_engine.kv.pool import BlockPool

BLOCK = 16
GEOMETRY = KVGeometry(num_layers=2, kv_heads=2, head_dim=8, dtype=torch.float32)


def sequences(shared_blocks: int, own_tokens: list[int]):
    pool = BlockPool(GEOMETRY, 64 * BLOCK * GEOMETRY.bytes_per_token, "cpu", block_tokens=BLOCK)
    torch.manual_seed(0)
    pool.ram.normal_()
    prefix = pool.allocate(shared_blocks)
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


@pytest.mark.parametrize("own_tokens", [[1, 5, 17], [3, 3], [40, 1, 2, 33]])
def test_shared_prefix_attention_writes_the_new_kv_and_matches_each_sequence_alone(own_tokens):
    seqs, ends = sequences(4, own_tokens)
    shared = seqs[0].shared_prefix(seqs, ends)
    assert shared == 4 * BLOCK
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
