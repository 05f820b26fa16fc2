"""The radix chunk cache on its own, with fake KV tensors (no model)."""
import pytest
import torch

from kvboost_engine.cache import ChunkCache
from kvboost_engine.errors import BudgetError

LAYERS, HEADS, DIM = 2, 1, 2
BYTES_PER_TOKEN = 2 * LAYERS * HEADS * DIM * 4


def kv_of(tokens):
    """Fake KV whose values encode (token, position), so misplaced data is detectable."""
    def kv_slice(start, end):
        t = torch.tensor(tokens[start:end], dtype=torch.float32)
        pos = torch.arange(start, end, dtype=torch.float32)
        return (t * 1000 + pos).view(1, 1, 1, -1, 1).expand(2, LAYERS, HEADS, -1, DIM).clone()
    return kv_slice


def matched(spans):
    return sum(span.length for span in spans)


def assert_spans_match(spans, tokens):
    for span in spans:
        position = span.start
        for kv, offset, count in span.pieces:
            expect = kv_of(tokens)(position, position + count)
            assert torch.equal(kv[:, :, :, offset:offset + count], expect)
            position += count


def make_cache(budget_tokens=1000):
    return ChunkCache(b"fp" * 8, budget_tokens * BYTES_PER_TOKEN, BYTES_PER_TOKEN)


def test_exact_prefix_and_token_level_partial_match():
    cache = make_cache()
    a = list(range(100, 140))
    cache.insert(a, [10, 25, 40], 40, kv_of(a))
    assert matched(cache.match(a)) == 40
    b = a[:17] + [1, 2, 3]                 # diverges inside the second chunk
    m = cache.match(b)
    assert matched(m) == 17
    assert_spans_match(m, b)
    cache.insert(b, [17, 20], 20, kv_of(b))  # splits the chunk at 17
    cache.check_invariants()
    assert matched(cache.match(a)) == 40 and matched(cache.match(b)) == 20
    assert_spans_match(cache.match(a), a)
    assert_spans_match(cache.match(b), b)


def test_limit_and_miss():
    cache = make_cache()
    a = list(range(10))
    cache.insert(a, [10], 10, kv_of(a))
    assert matched(cache.match(a, limit=9)) == 9
    assert matched(cache.match([5, 6])) == 0
    s = cache.stats()
    assert s["hits"] == 1 and s["misses"] == 1


def test_budget_never_exceeded_and_lru_leaves_evicted():
    cache = make_cache(budget_tokens=50)
    seqs = [[i] * 20 + list(range(1000 * i, 1000 * i + 10)) for i in range(1, 6)]
    for s in seqs:
        cache.insert(s, [20, 30], 30, kv_of(s))
        cache.check_invariants()
        assert cache.bytes_used <= cache.budget_bytes
    assert cache.stats()["evictions"] > 0
    assert matched(cache.match(seqs[-1])) == 30           # most recent survives
    assert matched(cache.match(seqs[0])) == 0              # oldest went


def test_over_budget_insert_stores_prefix_only():
    cache = make_cache(budget_tokens=25)
    s = list(range(60))
    stored = cache.insert(s, [10, 20, 30, 40, 50, 60], 60, kv_of(s))
    assert stored == 20
    assert cache.stats()["dropped_tokens"] == 40
    cache.check_invariants()


def test_pinned_chunks_survive_and_overpin_raises():
    cache = make_cache(budget_tokens=40)
    system = list(range(500, 520))
    cache.insert(system, [20], 20, kv_of(system), pin=True)
    for i in range(5):
        s = [i + 1] * 30
        cache.insert(s, [30], 30, kv_of(s))
        cache.check_invariants()
    assert matched(cache.match(system)) == 20
    with pytest.raises(BudgetError, match="cache_bytes"):
        big = list(range(2000, 2030))
        cache.insert(big, [30], 30, kv_of(big), pin=True)


def test_zero_budget_stores_nothing():
    cache = ChunkCache(b"x" * 16, 0, BYTES_PER_TOKEN)
    s = list(range(10))
    assert cache.insert(s, [10], 10, kv_of(s)) == 0
    assert matched(cache.match(s)) == 0


def test_prefix_keys_do_not_depend_on_chunk_boundaries():
    c1, c2 = make_cache(), make_cache()
    s = list(range(30))
    c1.insert(s, [10, 30], 30, kv_of(s))
    c2.insert(s, [30], 30, kv_of(s))
    leaf1 = [n for n in c1._lru.values() if not n.children][0]
    leaf2 = [n for n in c2._lru.values() if not n.children][0]
    assert leaf1.key == leaf2.key
