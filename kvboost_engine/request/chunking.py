"""Content-defined chunking over token ids.

A cut falls after token i when a hash of the `WINDOW` tokens ending at i hits a pattern, so the
cut points inside a text depend only on that text: the same document is cut the same way
wherever it sits, and its chunks re-synchronise a few tokens after any seam. Min and max sizes
keep chunks useful (not tiny, not unbounded).
"""
from __future__ import annotations

import numpy as np

WINDOW = 8
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
        for j in range(WINDOW):
            out[j:] += mixed[:len(mixed) - j] * _POWERS[j]
    return out


def content_cuts(token_ids, *, min_tokens: int, avg_tokens: int, max_tokens: int) -> list[int]:
    """Chunk ends (exclusive, ascending, last == len) for one segment's token ids."""
    n = len(token_ids)
    if n <= min_tokens:
        return [n] if n else []
    hashes = window_hashes(token_ids)
    candidates = np.flatnonzero((hashes >> np.uint64(24)) % np.uint64(avg_tokens) == 0) + 1
    cuts, last = [], 0
    for cut in candidates.tolist():
        while cut - last > max_tokens:
            last += max_tokens
            cuts.append(last)
        if cut - last >= min_tokens and n - cut >= min_tokens // 2:
            cuts.append(cut)
            last = cut
    while n - last > max_tokens:
        last += max_tokens
        cuts.append(last)
    cuts.append(n)
    return cuts
