"""Content-defined points in token ids: chunk cuts (request/chunking.py) and moved-reuse anchors.

A rolling hash over the WINDOW tokens ending at position i marks i + 1 as a candidate point when
it hits a pattern: the same text yields the same candidates wherever it sits. Anchors are the
ANCHOR_TOKENS tokens before each candidate (about one every ANCHOR_SPACING tokens), inside
content; unlike chunk cuts, whose minimum and maximum sizes make each cut depend on the previous
one, anchors depend on nothing but the text around them, so every document of a few dozen
tokens has some wherever it is placed, joined into one string or not.
"""
from __future__ import annotations

import numpy as np

WINDOW = 8
ANCHOR_SPACING = 8
ANCHOR_TOKENS = 16
_MULT = np.uint64(0x9E3779B97F4A7C15)
_POWERS = np.array([pow(0x100000001B3, j, 2**64) for j in range(WINDOW)], dtype=np.uint64)


def _mix(values: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: a well-spread 64-bit value per token id."""
    z = values.astype(np.uint64) * _MULT
    z ^= z >> np.uint64(31)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(29)
    return z


def window_hashes(token_ids) -> np.ndarray:
    """hash[i] over tokens i-WINDOW+1..i (fewer at the very start)."""
    mixed = _mix(np.asarray(token_ids, dtype=np.int64))
    out = np.zeros_like(mixed)
    with np.errstate(over="ignore"):
        for j in range(min(WINDOW, len(mixed))):
            out[j:] += mixed[:len(mixed) - j] * _POWERS[j]
    return out


def candidates(hashes: np.ndarray, spacing: int) -> np.ndarray:
    """Candidate points (exclusive ends, ascending) about `spacing` tokens apart."""
    return np.flatnonzero((hashes >> np.uint64(24)) % np.uint64(spacing) == 0) + 1


def anchor_ends(token_ids, regions: list[tuple[int, int]]) -> list[int]:
    """Ends `a` of the anchors [a - ANCHOR_TOKENS, a) lying inside one of `regions` (ascending [begin, end))."""
    if not regions:
        return []
    points = candidates(window_hashes(token_ids[:regions[-1][1]]), ANCHOR_SPACING)
    out = []
    for begin, end in regions:
        lo = np.searchsorted(points, begin + ANCHOR_TOKENS, side="left")
        hi = np.searchsorted(points, end, side="right")
        out.extend(points[lo:hi].tolist())
    return out


def content_regions(chunk_ends, chunk_kinds, skip: frozenset, start: int = 0, limit: int | None = None
                    ) -> list[tuple[int, int]]:
    """Maximal runs [begin, end) of consecutive chunks whose kind is not in `skip`, clipped to [start, limit)."""
    regions: list[tuple[int, int]] = []
    begin = 0
    for end, kind in zip(chunk_ends, chunk_kinds):
        chunk_begin, begin = begin, end
        if kind in skip:
            continue
        if regions and regions[-1][1] == chunk_begin:
            regions[-1] = (regions[-1][0], end)
        else:
            regions.append((chunk_begin, end))
    limit = chunk_ends[-1] if limit is None and chunk_ends else limit
    return [(max(b, start), min(e, limit)) for b, e in regions if min(e, limit) > max(b, start)]
