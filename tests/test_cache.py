"""The radix chunk cache over a block pool, with fake KV (no model)."""
import pytest
import torch

from kvboost_engine.kv.geometry import KVGeometry
from kvboost_engine.kv.cache import ChunkCache
from kvboost_engine.errors import BudgetError
from kvboost_engine.kv.pool import BlockPool

GEOMETRY = KVGeometry(num_layers=2, kv_heads=1, head_dim=2, dtype=torch.float32)
BYTES_PER_TOKEN = GEOMETRY.bytes_per_token
BLOCK = 4


def fake_kv(tokens, start, end):
    """KV whose values encode (token, position), so misplaced data is detectable."""
    t = torch.tensor(tokens[start:end], dtype=torch.float32)
    pos = torch.arange(start, end, dtype=torch.float32)
    return (t * 1000 + pos).view(1, 1, 1, -1, 1).expand(2, 2, 1, -1, 2).clone()


class Source:
    """A finished request holding KV for `tokens` (copied into new blocks when cached)."""

    allocates = True

    def __init__(self, pool, tokens):
        self.pool, self.tokens = pool, tokens

    def cache_blocks(self, first_index, end):
        blocks = self.pool.allocate(-(-end // BLOCK) - first_index)
        self.pool.write([None] * first_index + blocks, first_index * BLOCK,
                        fake_kv(self.tokens, first_index * BLOCK, end))
        return blocks


def make_cache(budget_tokens=1000, pool_tokens=None):
    pool = BlockPool(GEOMETRY, (pool_tokens or budget_tokens * 2) * BYTES_PER_TOKEN, "cpu", block_tokens=BLOCK)
    return ChunkCache(b"fp" * 8, budget_tokens * BYTES_PER_TOKEN, pool)


def insert(cache, tokens, ends, upto=None, **kw):
    return cache.insert(tokens, ends, upto or len(tokens), Source(cache.pool, tokens), **kw)


def matched(cache, tokens, limit=None):
    """Matched length, checking that the block table really holds those tokens' KV."""
    match = cache.match(tokens, len(tokens) if limit is None else limit)
    try:
        if match.length:
            got = cache.pool.read(match.table, 0, match.length)
            assert torch.equal(got, fake_kv(tokens, 0, match.length))
    finally:
        cache.release(match.table)
    return match.length


def test_exact_prefix_and_token_level_partial_match():
    cache = make_cache()
    a = list(range(100, 140))
    insert(cache, a, [10, 25, 40])
    assert matched(cache, a) == 40
    b = a[:17] + [1, 2, 3]                 # diverges inside the second chunk and inside a block
    assert matched(cache, b) == 17
    insert(cache, b, [17, 20])             # splits the chunk at 17
    cache.check_invariants()
    assert matched(cache, a) == 40 and matched(cache, b) == 20


def test_limit_and_miss():
    cache = make_cache()
    a = list(range(10))
    insert(cache, a, [10])
    assert matched(cache, a, 9) == 9
    assert matched(cache, [5, 6]) == 0
    s = cache.stats()
    assert s["hits"] == 1 and s["misses"] == 1


def test_budget_never_exceeded_and_lru_leaves_evicted():
    cache = make_cache(budget_tokens=52)
    seqs = [[i] * 20 + list(range(1000 * i, 1000 * i + 10)) for i in range(1, 6)]
    for s in seqs:
        insert(cache, s, [20, 30])
        cache.check_invariants()
        assert cache.bytes_used <= cache.budget_bytes
    assert cache.stats()["evictions"] > 0
    assert matched(cache, seqs[-1]) == 30          # most recent survives
    assert matched(cache, seqs[0]) == 0            # oldest went
    cache.check_invariants()


def test_over_budget_insert_stores_prefix_only():
    cache = make_cache(budget_tokens=24)
    s = list(range(60))
    stored = insert(cache, s, [12, 20, 32, 40, 52, 60])
    assert stored == 20
    assert cache.stats()["dropped_tokens"] == 40
    cache.check_invariants()


def test_pinned_chunks_survive_and_overpin_raises():
    cache = make_cache(budget_tokens=40)
    system = list(range(500, 520))
    insert(cache, system, [20], pin=True)
    for i in range(5):
        insert(cache, [i + 1] * 16, [16])
        cache.check_invariants()
    assert matched(cache, system) == 20
    with pytest.raises(BudgetError, match="cache_bytes"):
        insert(cache, list(range(2000, 2032)), [32], pin=True)


def test_zero_budget_stores_nothing():
    cache = make_cache(budget_tokens=0, pool_tokens=64)
    s = list(range(10))
    assert insert(cache, s, [10]) == 0
    assert matched(cache, s) == 0


def test_prefix_keys_do_not_depend_on_chunk_boundaries():
    c1, c2 = make_cache(), make_cache()
    s = list(range(30))
    insert(c1, s, [10, 30])
    insert(c2, s, [30])
    leaf1 = [n for n in c1.tree.nodes.values() if not n.children][0]
    leaf2 = [n for n in c2.tree.nodes.values() if not n.children][0]
    assert leaf1.key == leaf2.key


def test_make_room_evicts_cached_blocks_for_running_sequences():
    cache = make_cache(budget_tokens=64, pool_tokens=64)
    insert(cache, list(range(64)), [32, 64])
    assert cache.pool.free_blocks() == 0
    cache.make_room(4)
    assert cache.pool.free_blocks() >= 4
    cache.check_invariants()


def test_matched_blocks_are_held_and_eviction_that_frees_nothing_is_skipped():
    cache = make_cache(budget_tokens=32, pool_tokens=32)
    a = list(range(32))
    insert(cache, a, [32])
    match = cache.match(a, 32)
    cache.make_room(8)                     # the match holds every block: evicting would free nothing
    assert cache.stats()["evictions"] == 0 and cache.stats()["nodes"] == 1
    assert torch.equal(cache.pool.read(match.table, 0, 32), fake_kv(a, 0, 32))
    cache.release(match.table)
    cache.make_room(8)
    assert cache.pool.free_blocks() == 8
    cache.check_invariants()


def test_make_room_that_cannot_succeed_evicts_nothing():
    cache = make_cache(budget_tokens=64, pool_tokens=64)
    insert(cache, list(range(32)), [32])
    cache.pool.allocate(8)                 # a running sequence holds the rest of the pool
    cache.make_room(12)                    # 8 cached blocks could be freed, 12 are needed
    assert cache.stats()["nodes"] == 1 and cache.stats()["evictions"] == 0


def test_pin_that_does_not_fit_raises_instead_of_storing_nothing():
    cache = make_cache(budget_tokens=10)   # 2 blocks of 4; 9 tokens need 3 blocks
    with pytest.raises(BudgetError):
        insert(cache, list(range(9)), [9], pin=True)
    assert cache.budget.pinned_bytes == 0


def test_exact_positions_are_never_read_from_a_block_an_inexact_source_wrote():
    cache = make_cache()
    tokens = list(range(100, 130))
    insert(cache, tokens[:22], [22])                      # exact KV for positions 0..21

    class Approximate(Source):
        def cache_blocks(self, first_index, end):
            blocks = super().cache_blocks(first_index, end)
            table = [None] * first_index + blocks
            self.pool.write(table, first_index * BLOCK, fake_kv(self.tokens, first_index * BLOCK, end) + 0.5)
            return blocks

    cache.insert(tokens, [22, 30], 30, Approximate(cache.pool, tokens), exact_upto=10)
    match = cache.match(tokens, 30)
    exact = sum(s.length for s in match.spans if s.exact)
    assert exact == 22
    assert torch.equal(cache.pool.read(match.table, 0, exact), fake_kv(tokens, 0, exact))
    cache.release(match.table)
    cache.check_invariants()


def test_a_disk_entry_the_cache_cannot_hold_is_neither_read_nor_allowed_to_flush_it(tmp_path):
    """A chunk written by a run with a larger cache_bytes (same directory): a smaller cache skips it
    before reading it, and keeps what it holds (it used to read it, evict every other chunk to
    adopt it, drop it too, and do so again on every lookup)."""
    from kvboost_engine.kv.disk import DiskTier
    from kvboost_engine.kv.pool import BlockPool

    def cache_over(directory, budget_tokens):
        pool = BlockPool(GEOMETRY, 2 * budget_tokens * BYTES_PER_TOKEN, "cpu", block_tokens=BLOCK)
        disk = DiskTier(directory, 1 << 20, b"fp" * 8, fsync=False)
        return ChunkCache(b"fp" * 8, budget_tokens * BYTES_PER_TOKEN, pool, disk), disk

    big, disk = cache_over(tmp_path, 64)
    doc = list(range(100, 140)) + [7]
    big.insert(doc, [40, 41], 40, Source(big.pool, doc))
    disk.flush()
    disk.close()
    small, disk = cache_over(tmp_path, 32)
    hot = [list(range(1, 10)), list(range(11, 20))]
    for tokens in hot:
        insert(small, tokens, [len(tokens)])
    for _ in range(3):
        match = small.match(doc, 40, [40, 41])
        small.release(match.table)
        assert match.length == 0
    assert [small.cached_prefix(tokens, len(tokens)) for tokens in hot] == [9, 9]
    assert small.stats()["evictions"] == 0 and disk.stats()["bytes_read"] == 0
    small.check_invariants()
    disk.close()


def test_make_room_does_not_count_the_ancestors_of_a_protected_chunk_as_freeable():
    cache = make_cache(budget_tokens=64, pool_tokens=64)          # 16 blocks of 4 tokens
    insert(cache, list(range(100, 132)), [16, 32])                # A1 [0, 16) -> A2 [16, 32): 8 blocks
    insert(cache, list(range(1, 9)), [8])                         # C: 2 blocks
    cache.pool.allocate(6)                                        # running requests hold the rest
    a2 = next(n for n in cache.tree.nodes.values() if n.end == 32)
    cache.make_room(4, {a2.uid})        # only C (2 blocks) can go: A1 never becomes a leaf above A2
    assert cache.stats()["nodes"] == 3 and cache.stats()["evictions"] == 0
    cache.check_invariants()
