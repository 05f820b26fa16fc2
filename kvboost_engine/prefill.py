"""Prefill with reuse: plan (exact prefix + moved spans + new tokens), load KV, compute the rest.

- Exact prefix KV is copied in as is.
- Moved spans (documents / plain text cached elsewhere) are copied in and their keys
  re-rotated to the new positions; then, by strategy:
    blend - every moved token is recomputed up to the check layer, and only those whose KV
            deviates most (plus the first tokens of each span) from there on;
    none  - moved tokens are not recomputed at all;
    full  - moved lookup is skipped: everything after the exact prefix is computed.
- New tokens are always computed through all layers. The last prompt token is never reused,
  so there are logits to sample from.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from .arch import ModelAdapter
from .blend import Selector
from .cache import ChunkCache
from .config import EngineConfig
from .forward import Forward
from .kv import SequenceKV
from .rope import RopeMover
from .tokens import TokenizedPrompt
from .tree import KVSpan


@dataclass(slots=True)
class Prefilled:
    """Logits after the prompt and what the prompt's KV is made of."""

    logits: torch.Tensor
    reused_exact: int       # from exact-prefix hits on exact KV
    reused_moved: int       # from moved hits (or prefix hits on repaired KV)
    recomputed: int         # moved tokens the repair then recomputed through every layer
    exact_upto: int         # KV before this position equals a full prefill's


@dataclass(slots=True)
class PrefillParts:
    adapter: ModelAdapter
    forward: Forward
    cache: ChunkCache
    mover: RopeMover
    config: EngineConfig
    compute_lock: threading.Lock


def prefill(parts: PrefillParts, prompt: TokenizedPrompt, kv: SequenceKV, max_position: int) -> Prefilled:
    """Fill `kv` for the whole prompt, reusing what the cache has; return last-position logits."""
    n = len(prompt)
    prefix = parts.cache.match(prompt.token_ids, limit=n - 1)
    prefix_len = sum(span.length for span in prefix)
    moved = _moved_spans(parts, prompt, prefix_len, max_position)
    for span in prefix + moved:
        _load(parts, kv, span)
    reused_exact = sum(s.length for s in prefix if s.exact)
    exact_upto = next((s.start for s in prefix if not s.exact), moved[0].start if moved else n)
    reused_moved = prefix_len - reused_exact + sum(s.length for s in moved)
    recomputed = 0
    with parts.compute_lock:
        if not moved:
            logits = parts.forward(kv, prompt.token_ids[prefix_len:], prefix_len)
        else:
            logits, recomputed = _repair(parts, prompt, kv, prefix_len, moved)
    return Prefilled(logits, reused_exact, reused_moved, recomputed, exact_upto)


def _moved_spans(parts: PrefillParts, prompt: TokenizedPrompt, prefix_len: int, max_position: int) -> list[KVSpan]:
    if parts.config.moved_reuse == "full" or not parts.mover.can_move(max_position):
        return []
    n = len(prompt)
    return parts.cache.match_moved(prompt.token_ids, prompt.chunk_ends, prompt.chunk_kinds, prefix_len, n - 1)


def _load(parts: PrefillParts, kv: SequenceKV, span: KVSpan) -> None:
    position = span.start
    for chunk_kv, offset, count in span.pieces:
        kv.load_chunk(chunk_kv[:, :, :, offset:offset + count], position)
        position += count
    if span.source_start != span.start:
        keys = kv.data[0, :, 0, :, span.start:span.start + span.length]       # [layers, kv_heads, n, D]
        parts.mover.move(keys, span.source_start, span.start)


def _repair(parts: PrefillParts, prompt: TokenizedPrompt, kv: SequenceKV, prefix_len: int,
            moved: list[KVSpan]) -> tuple[torch.Tensor, int]:
    """Compute new tokens (and, for blend, selected moved tokens). Returns (logits, moved tokens recomputed)."""
    n = len(prompt)
    is_moved = torch.zeros(n, dtype=torch.bool)
    is_head = torch.zeros(n, dtype=torch.bool)
    for span in moved:
        is_moved[span.start:span.start + span.length] = True
        is_head[span.start:span.start + parts.config.recompute_head_tokens] = True
    positions = torch.arange(prefix_len, n)
    if parts.config.moved_reuse == "none":
        positions = positions[~is_moved[prefix_len:]]
        return parts.forward.scattered(kv, prompt.token_ids, positions, n), 0
    layer = min(parts.config.check_layer, len(parts.adapter.layers) - 1)
    selector = Selector(is_moved[positions], is_head[positions], parts.config.recompute_ratio, layer)
    logits = parts.forward.scattered(kv, prompt.token_ids, positions, n, selector)
    return logits, selector.recomputed_moved
