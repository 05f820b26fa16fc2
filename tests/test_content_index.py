"""The content index: chunks found by content anywhere in the tree, kept in step with splits and evictions."""
from test_cache import fake_kv, insert, make_cache


def doc(seed: int, n: int = 24) -> list[int]:
    return [1000 * seed + i for i in range(n)]


def spans(cache, tokens, ends, kinds, start=0):
    found = cache.match_moved(tokens, ends, kinds, start, len(tokens))
    for span in found:
        cache.release(span.table)
    return found


def test_a_chunk_is_found_at_another_position_and_grown_over_its_seams():
    cache = make_cache()
    a, b = doc(1), doc(2)
    prompt = [7, 7] + a + b
    insert(cache, prompt, [2, 2 + 12, 2 + 24, 2 + 36, 2 + 48], chunk_kinds=["glue"] + ["document"] * 4)
    moved = [9, 9, 9] + b + a                      # the same documents, other order and offset
    ends = [3, 3 + 12, 3 + 24, 3 + 36, 3 + 48]
    found = spans(cache, moved, ends, ["glue", "document", "document", "document", "document"], start=3)
    assert [(s.start, s.length, s.source_start) for s in found] == [(3, 24, 26), (27, 24, 2)]
    for span in found:                             # the source positions hold those very tokens
        source = prompt[span.source_start:span.source_start + span.length]
        assert source == moved[span.start:span.start + span.length]
    cache.check_invariants()


def test_glue_and_generated_chunks_are_not_indexed():
    cache = make_cache()
    a = doc(3)
    insert(cache, a, [12, 24], chunk_kinds=["glue", "generated"])
    assert len(cache.index) == 0
    assert spans(cache, [5] + a, [1, 13, 25], ["glue", "document", "document"], start=1) == []


def test_entries_follow_splits():
    cache = make_cache()
    a = doc(4)
    insert(cache, a, [24], chunk_kinds=["document"])
    insert(cache, a[:10] + [1, 2, 3], [10, 13], chunk_kinds=["document", "document"])   # splits a's node at 10
    cache.check_invariants()
    found = spans(cache, [8] + a, [1, 25], ["glue", "document"], start=1)
    assert [(s.start, s.length, s.source_start) for s in found] == [(1, 24, 0)]


def test_entries_go_with_evicted_nodes_even_when_the_chunk_starts_in_a_shared_node():
    """A user message that shares its first words with an earlier one starts in a shared node;
    its entry must go when its own tail is evicted, or the index grows without bound."""
    cache = make_cache(budget_tokens=64)
    prefix = [1, 2, 3, 4]
    for i in range(40):
        message = [50, 51, 52] + [100 + i * 7 + k for k in range(6)]       # "What is the ..." + unique words
        tokens = prefix + message
        insert(cache, tokens, [4, len(tokens)], chunk_kinds=["glue", "user"])
        cache.check_invariants()
    stats = cache.stats()
    assert stats["evictions"] > 0
    assert len(cache.index) <= stats["nodes"]


def test_a_moved_hit_reads_the_kv_of_its_source_positions():
    cache = make_cache()
    a = doc(5)
    insert(cache, [3] + a, [1, 25], chunk_kinds=["glue", "document"])
    found = cache.match_moved([4, 4] + a, [2, 26], ["glue", "document"], 2, 26)
    try:
        span = found[0]
        kv = cache.pool.read(span.table, span.source_start, span.length)
        assert kv.equal(fake_kv([3] + a, 1, 25))
    finally:
        for span in found:
            cache.release(span.table)
