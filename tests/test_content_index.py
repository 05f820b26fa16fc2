"""The content index: content found by anchors anywhere in the tree, kept in step with splits and evictions."""
import random

from kvboost_engine.kv.anchors import ANCHOR_TOKENS, anchor_ends
from test_cache import fake_kv, insert, make_cache


def doc(seed: int, n: int = 60) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 40000) for _ in range(n)]


def spans(cache, tokens, ends, kinds, start=0):
    found = cache.match_moved(tokens, ends, kinds, start, len(tokens))
    for span in found:
        cache.release(span.table)
    return found


def test_every_document_of_a_few_dozen_tokens_has_anchors_wherever_it_sits():
    for seed in range(20):
        d = doc(seed)
        alone = [a for a in anchor_ends(d, [(0, len(d))])]
        placed = [a - 37 for a in anchor_ends(doc(99, 37) + d, [(37, 37 + len(d))])]
        assert alone and alone == placed                    # the same points, relative to the document


def test_documents_are_found_at_another_position_and_grown_over_their_seams():
    cache = make_cache()
    a, b = doc(1), doc(2)
    prompt = [7, 7] + a + b
    insert(cache, prompt, [2, 62, 122], chunk_kinds=["glue", "document", "document"])
    moved = [9, 9, 9] + b + a                      # the same documents, other order and offset
    found = spans(cache, moved, [3, 63, 123], ["glue", "document", "document"], start=3)
    assert [(s.start, s.length, s.source_start) for s in found] == [(3, 60, 62), (63, 60, 2)]
    for span in found:                             # the source positions hold those very tokens
        assert prompt[span.source_start:span.source_start + span.length] == moved[span.start:span.start + span.length]
    cache.check_invariants()


def test_documents_joined_into_one_string_are_found_whole():
    cache = make_cache()
    docs = [doc(10 + i) for i in range(4)]
    for d in docs:                                 # each first seen alone, after another prefix
        insert(cache, [5] + d, [1, 1 + len(d)], chunk_kinds=["glue", "user"])
    joined = [8, 8] + [t for d in (docs[2], docs[0], docs[3], docs[1]) for t in d]
    found = spans(cache, joined, [2, len(joined)], ["glue", "system"], start=2)
    assert sum(s.length for s in found) == 4 * 60


def test_a_phrase_shared_by_documents_grows_from_the_right_one():
    cache = make_cache()
    phrase = doc(50, 20)
    first, second = doc(51, 30) + phrase + doc(52, 30), doc(53, 30) + phrase + doc(54, 30)
    insert(cache, [1] + first, [1, 81], chunk_kinds=["glue", "document"])
    insert(cache, [2] + second, [1, 81], chunk_kinds=["glue", "document"])
    found = spans(cache, [3, 3] + second, [2, 82], ["glue", "document"], start=2)
    assert [(s.start, s.length) for s in found] == [(2, 80)]


def test_glue_and_generated_tokens_are_not_indexed():
    cache = make_cache()
    a = doc(3)
    insert(cache, a, [30, 60], chunk_kinds=["glue", "generated"])
    assert len(cache.index) == 0
    assert spans(cache, [5] + a, [1, 31, 61], ["glue", "document", "document"], start=1) == []


def test_places_follow_splits():
    cache = make_cache()
    a = doc(4)
    insert(cache, a, [60], chunk_kinds=["document"])
    insert(cache, a[:25] + [1, 2, 3], [25, 28], chunk_kinds=["document", "document"])   # splits a's node at 25
    cache.check_invariants()
    found = spans(cache, [8] + a, [1, 61], ["glue", "document"], start=1)
    assert [(s.start, s.length, s.source_start) for s in found] == [(1, 60, 0)]


def test_places_go_with_evicted_nodes_even_when_they_start_in_a_shared_node():
    """A user message that shares its first words with an earlier one starts in a shared node;
    its places must go when its own tail is evicted, or the index grows without bound."""
    cache = make_cache(budget_tokens=200)
    prefix, opening = [1, 2, 3, 4], doc(60, 10)
    for i in range(40):
        tokens = prefix + opening + doc(100 + i, 30)       # "What is the ..." + different words
        insert(cache, tokens, [4, len(tokens)], chunk_kinds=["glue", "user"])
        cache.check_invariants()
    stats = cache.stats()
    assert stats["evictions"] > 0
    stored = sum(len(node.tokens) for node in cache.tree.nodes.values())
    assert len(cache.index) <= stored


def test_a_moved_hit_reads_the_kv_of_its_source_positions():
    cache = make_cache()
    a = doc(5)
    insert(cache, [3] + a, [1, 61], chunk_kinds=["glue", "document"])
    found = cache.match_moved([4, 4] + a, [2, 62], ["glue", "document"], 2, 62)
    try:
        span = found[0]
        kv = cache.pool.read(span.table, span.source_start, span.length)
        assert kv.equal(fake_kv([3] + a, 1, 61))
    finally:
        for span in found:
            cache.release(span.table)


def test_anchor_windows_are_short():
    assert ANCHOR_TOKENS <= 16


def test_sequences_shorter_than_the_hash_window_have_hashes_and_no_anchors():
    from kvboost_engine.kv.anchors import WINDOW, window_hashes
    for n in range(WINDOW + 1):
        tokens = doc(n, n)
        assert len(window_hashes(tokens)) == n
        assert anchor_ends(tokens, [(0, n)] if n else []) == []
