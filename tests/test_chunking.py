"""Content-defined cuts: the same text is cut the same way wherever it sits."""
import random

import pytest

from kvboost_engine.request.chunking import WINDOW, content_cuts

SIZES = dict(min_tokens=16, avg_tokens=32, max_tokens=256)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(49152) for _ in range(n)]


def cuts_inside(ids: list[int], begin: int, end: int) -> list[int]:
    """Cut points of `ids` that fall inside [begin, end), relative to `begin`."""
    return [c - begin for c in content_cuts(ids, **SIZES) if begin <= c < end]


def test_cuts_end_at_the_length_and_respect_the_sizes():
    ids = tokens(0, 3000)
    cuts = content_cuts(ids, **SIZES)
    assert cuts[-1] == len(ids) and cuts == sorted(set(cuts))
    sizes = [b - a for a, b in zip([0] + cuts, cuts)]
    assert max(sizes) <= SIZES["max_tokens"]
    assert min(sizes[:-1]) >= SIZES["min_tokens"]
    assert sizes[-1] >= SIZES["min_tokens"] // 2
    assert 20 < len(cuts) < 3000 // SIZES["min_tokens"]       # content-defined: near the average, not max-size


def test_short_and_empty_segments():
    assert content_cuts([], **SIZES) == []
    assert content_cuts(tokens(1, 10), **SIZES) == [10]
    assert content_cuts(tokens(1, 16), **SIZES) == [16]


def test_cuts_depend_only_on_content():
    ids = tokens(2, 2000)
    assert content_cuts(ids, **SIZES) == content_cuts(list(ids), **SIZES)
    assert content_cuts(ids, **SIZES) != content_cuts(tokens(3, 2000), **SIZES)


@pytest.mark.parametrize("prefix_length", [0, 1, 7, 33, 150, 511])
def test_a_document_is_cut_the_same_way_after_any_prefix(prefix_length):
    document = tokens(4, 1500)
    alone = cuts_inside(document, 0, len(document))
    placed = tokens(5, prefix_length) + document + tokens(6, 40)
    inside = cuts_inside(placed, prefix_length, prefix_length + len(document))
    # the cuts re-synchronise within a few chunks of the seam, and agree from there on (short of
    # the document's end, where the segment's own length matters)
    settle = next(c for c in alone if c in inside)
    assert settle <= 4 * SIZES["avg_tokens"] + WINDOW
    end = len(document) - SIZES["min_tokens"]
    assert [c for c in alone if settle <= c < end] == [c for c in inside if settle <= c < end]


def test_every_moved_document_keeps_whole_chunks_to_anchor_on():
    """Documents joined in another order still share chunks lying inside each of them (moved
    reuse finds those by content and grows each hit to the document's edges)."""
    documents = [tokens(10 + i, 400) for i in range(5)]
    first = [t for d in documents for t in d]
    second = [t for d in (documents[3], documents[0], documents[4], documents[2], documents[1]) for t in d]

    def chunks(ids):
        cuts = content_cuts(ids, **SIZES)
        return {tuple(ids[a:b]) for a, b in zip([0] + cuts, cuts)}

    shared = chunks(first) & chunks(second)
    for document in documents:
        text = tuple(document)
        inside = [c for c in shared if any(text[i:i + len(c)] == c for i in range(len(text) - len(c) + 1))]
        assert sum(len(c) for c in inside) >= 0.5 * len(document)
