"""Content-defined chunking over token ids.

A cut falls after token i when a hash of the `WINDOW` tokens ending at i hits a pattern, so the
cut points inside a text depend only on that text: the same document is cut the same way
wherever it sits, and its chunks re-synchronise a few tokens after any seam. Min and max sizes
keep chunks useful (not tiny, not unbounded).
"""
from __future__ import annotations

from ..kv.anchors import WINDOW, candidates, window_hashes

__all__ = ["WINDOW", "content_cuts", "window_hashes"]


def content_cuts(token_ids, *, min_tokens: int, avg_tokens: int, max_tokens: int) -> list[int]:
    """Chunk ends (exclusive, ascending, last == len) for one segment's token ids."""
    n = len(token_ids)
    if n <= min_tokens:
        return [n] if n else []
    hashes = window_hashes(token_ids)
    cuts, last = [], 0
    for cut in candidates(hashes, avg_tokens).tolist():
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
