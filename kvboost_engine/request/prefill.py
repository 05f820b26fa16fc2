"""Prefill with reuse: plan (exact prefix + moved spans + new tokens), build the sequence's KV,
compute the rest.

- Exact prefix KV: a paged sequence maps the cached blocks (a shared partial last block is
  copied on write); a contiguous sequence copies them in.
- Moved spans (documents / plain text cached elsewhere) are copied in with their keys
  re-rotated to the new positions; then, by strategy:
    blend - every moved token is recomputed up to the check layer, and only those whose KV
            deviates most (plus the first tokens of each span) from there on;
    none  - moved tokens are not recomputed at all;
    full  - moved lookup is skipped: everything after the exact prefix is computed.
- New tokens are always computed through all layers. The last prompt token is never reused,
  so there are logits to sample from.
All memory a request needs is reserved before any compute; if the pool cannot provide it even
after evicting cached chunks, the request is refused with a BudgetError.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import EngineConfig
from ..errors import BudgetError
from ..kv.cache import ChunkCache, Match
from ..kv.contiguous import SequenceKV
from ..kv.element import load, store
from ..kv.paged import PagedSequence
from ..kv.tree import KVSpan
from ..model.arch import ModelAdapter
from ..model.rope import RopeMover
from .blend import repair_moved
from .runner import ModelRunner
from .tokens import TokenizedPrompt


@dataclass(slots=True)
class Prefilled:
    """The sequence holding the prompt's KV, logits after the prompt, and what the KV is made of."""

    sequence: object
    logits: torch.Tensor
    reused_exact: int       # from exact-prefix hits on exact KV
    reused_moved: int       # from moved hits (or prefix hits on repaired KV)
    recomputed: int         # moved tokens the repair then recomputed through every layer
    exact_upto: int         # KV before this position equals a full prefill's


@dataclass(slots=True)
class PrefillParts:
    adapter: ModelAdapter
    runner: ModelRunner
    cache: ChunkCache
    mover: RopeMover
    config: EngineConfig


@dataclass(slots=True)
class Assembled:
    """A request's sequence with its reused KV in place (exact prefix mapped, moved spans loaded),
    before anything is computed; the caller owns `sequence` (release it on failure)."""

    prompt: TokenizedPrompt
    sequence: object
    match: Match
    moved: list[KVSpan]

    @property
    def start(self) -> int:
        """First position to compute (when nothing moved: the rest is plain prefill)."""
        return self.match.length


def prefill(parts: PrefillParts, prompt: TokenizedPrompt, new_tokens: int) -> Prefilled:
    """Build a sequence for prompt + `new_tokens`, reusing what the cache has; compute the rest."""
    assembled = assemble(parts, prompt, new_tokens)
    try:
        if assembled.moved:
            return repair(parts, assembled)
        return prefilled(assembled, _chunked(parts, assembled.sequence, prompt.token_ids, assembled.start))
    except BaseException:
        assembled.sequence.release()
        raise


def assemble(parts: PrefillParts, prompt: TokenizedPrompt, new_tokens: int) -> Assembled:
    """Reserve the KV of prompt + `new_tokens` and put in place what the cache has (BudgetError
    if the pool cannot hold it even after evicting cached chunks)."""
    try:
        return Assembled(prompt, *_assemble(parts, prompt, new_tokens, use_moved=True))
    except _MovedSourcesHeldTheRoom:
        # The moved spans' source blocks, held while the sequence is built, were what was missing:
        # a request that fits the pool alone runs, with those tokens recomputed instead.
        return Assembled(prompt, *_assemble(parts, prompt, new_tokens, use_moved=False))


def prefilled(assembled: Assembled, logits: torch.Tensor, recomputed: int = 0) -> Prefilled:
    """The result of a prefill whose new tokens were computed: what the KV is made of."""
    match, moved, n = assembled.match, assembled.moved, len(assembled.prompt)
    reused_exact = sum(s.length for s in match.spans if s.exact)
    exact_upto = next((s.start for s in match.spans if not s.exact), moved[0].start if moved else n)
    reused_moved = match.length - reused_exact + sum(s.length for s in moved)
    return Prefilled(assembled.sequence, logits, reused_exact, reused_moved, recomputed, exact_upto)


def repair(parts: PrefillParts, assembled: Assembled) -> Prefilled:
    """Compute the new tokens of a prompt with moved spans (and, for blend, the selected moved ones)."""
    logits, recomputed = repair_moved(parts.runner, parts.config, len(parts.adapter.layers), assembled.prompt,
                                      assembled.sequence, assembled.start, assembled.moved)
    return prefilled(assembled, logits, recomputed)


class _MovedSourcesHeldTheRoom(Exception):
    pass


def _assemble(parts: PrefillParts, prompt: TokenizedPrompt, new_tokens: int, use_moved: bool):
    """(sequence with the exact prefix and moved spans in place, the match, the moved spans)."""
    n = len(prompt)
    long_call = parts.adapter.regime_limit is not None and n > parts.adapter.regime_limit
    exact_only = parts.config.moved_reuse == "full" and not parts.config.disk_kv_int8     # replies as no cache's
    match = parts.cache.match(prompt.token_ids, 0 if long_call else n - 1, prompt.chunk_ends, exact_only)
    moved, sequence, handed_over = [], None, False
    use_moved = use_moved and not long_call
    try:
        if use_moved:
            moved = _moved_spans(parts, prompt, match.length, n + new_tokens)
        handed_over = True                  # from here _sequence owns match.table, even when it fails
        sequence = _sequence(parts, match, n + new_tokens, may_drop=not moved)
        sequence.rope_end = n               # its chunks' rotary as the prompt's one call (longrope)
        for span in moved:
            _load_moved(parts, sequence, span)
    except BaseException as err:
        if sequence is not None:
            sequence.release()
        elif not handed_over:
            parts.cache.release(match.table)
        if isinstance(err, BudgetError) and moved:
            raise _MovedSourcesHeldTheRoom() from err
        raise
    finally:
        for span in moved:
            parts.cache.release(span.table)
    return sequence, match, moved


def _sequence(parts: PrefillParts, match: Match, capacity: int, may_drop: bool = True):
    """A sequence with the matched prefix in place and room for `capacity` positions (`may_drop`, no
    moved spans held: a match that keeps the pool from making that room is given back whole)."""
    pool = parts.cache.pool
    if not parts.config.paged:
        sequence = SequenceKV(parts.adapter.geometry, capacity, parts.adapter.device, pool)
        try:
            if match.length:
                sequence.load(pool.read(match.table, 0, match.length), 0)
        finally:
            parts.cache.release(match.table)
        return sequence
    b = pool.block_tokens
    own = -(-capacity // b) - len(match.table) + (1 if match.length % b else 0)
    parts.cache.make_room(own)
    if match.length % b and pool.free_blocks() < own:
        # No room for a private copy of the shared partial block next to it: give the block back
        # and recompute its positions instead (a request that fits the pool alone always runs).
        _trim_to_block(match, parts.cache)
        parts.cache.make_room(own)              # as many own blocks, but the shared one is free to go
    if may_drop and match.length and pool.free_blocks() < own:
        # Still short: the matched chunks hold blocks eviction cannot reach while this request maps
        # them (a chunk split by another branch keeps a copy of its first block): give the whole
        # match back and compute the prompt from its start (a request that fits alone runs).
        parts.cache.give_back(match)
        own = -(-capacity // b)
        parts.cache.make_room(own)
    sequence = PagedSequence(pool, capacity)
    sequence.map_shared(match.table)
    try:
        if match.length % b:
            sequence.copy_on_write(match.length // b, match.length)
        sequence.reserve()
    except BaseException as err:
        sequence.release()
        if isinstance(err, BudgetError):
            raise BudgetError(f"request refused before any work: it needs KV for {capacity} positions; {err}") from None
        raise
    return sequence


def _trim_to_block(match: Match, cache: ChunkCache) -> None:
    """Shorten `match` to its last whole block, giving back the partial block's reference."""
    drop = match.length % cache.block_tokens
    cache.release([match.table.pop()])
    while drop:
        span = match.spans[-1]
        node, offset, count = span.pieces[-1]
        take = min(drop, count)
        span.length -= take
        drop -= take
        if take == count:
            span.pieces.pop()
        else:
            span.pieces[-1] = (node, offset, count - take)
        if not span.pieces:
            match.spans.pop()


def _moved_spans(parts: PrefillParts, prompt: TokenizedPrompt, prefix_len: int, max_position: int) -> list[KVSpan]:
    if parts.config.moved_reuse == "full" or not parts.mover.can_move(max_position):
        return []
    trim = (lambda spans: window_rule(spans, parts.adapter.layer_windows, parts.cache)) \
        if parts.config.moved_window_rule else None
    return parts.cache.match_moved(prompt.token_ids, prompt.chunk_ends, prompt.chunk_kinds, prefix_len,
                                   len(prompt) - 1, trim=trim)


def window_rule(spans: list[KVSpan], layer_windows: tuple, cache: ChunkCache) -> list[KVSpan]:
    """On models with sliding-window layers, only the part of a moved span beyond its first W - 1
    tokens is moved (W: the largest window).

    In a window layer the query at span offset i sees keys from offset i - W + 1 on: for i < W - 1
    that reaches into the content before the span, which differs from what preceded it where it
    was cached; those tokens are computed as new tokens (not reused), for every strategy. From
    offset W - 1 on, a window layer sees only span tokens. Spans no longer than W - 1 are not moved.
    """
    guard = max((w for w in layer_windows if w), default=1) - 1
    if guard <= 0:
        return spans
    kept = []
    for span in spans:
        if span.length <= guard:
            cache.release(span.table)
            continue
        span.start, span.source_start, span.length = span.start + guard, span.source_start + guard, span.length - guard
        kept.append(span)
    return kept


def _load_moved(parts: PrefillParts, sequence, span: KVSpan) -> None:
    kv = parts.cache.pool.read(span.table, span.source_start, span.length)
    if span.source_start != span.start:
        if kv.dtype == torch.int8:                      # int8 rows: rotated as values, stored again
            keys = load(kv[0], torch.float32)
            parts.mover.move(keys, span.source_start, span.start)
            kv[0] = store(keys, torch.int8)
        else:
            parts.mover.move(kv[0], span.source_start, span.start)         # keys [layers, kv_heads, n, D]
    sequence.load(kv, span.start)


def _chunked(parts: PrefillParts, sequence, token_ids: list[int], start: int) -> torch.Tensor:
    """Compute token_ids[start:] in pieces of prefill_chunk_tokens (bounded activation and mask
    memory; other requests' decode steps can run between pieces)."""
    chunk = parts.config.prefill_chunk_tokens
    logits = None
    for begin in range(start, len(token_ids), chunk):
        logits = parts.runner.forward(sequence, token_ids[begin:begin + chunk], begin, "prefill")
    return logits
