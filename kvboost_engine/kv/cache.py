"""The chunk cache: a radix tree of token chunks whose KV lives in pool blocks, plus a content index.

- Exact lookup walks the tree by token ids from the root: token-exact prefix reuse, even
  inside a chunk (a partly matched node is split when the new prompt is stored). The result
  is a block table a paged sequence maps without copying.
- Moved lookup finds content chunks by key anywhere in the tree (content_index.py), grown over their seams.
- What stays is decided by the budget (budget.py); with a disk tier, new chunks are written
  through to disk and found there again after eviction or a restart (restore.py).

Composed of its parts: `tree` (radix.py), `index`, `budget`, `restore`; one lock over them.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

from ..errors import BudgetError
from .budget import CacheBudget
from .content_index import ContentIndex
from .keys import PrefixHasher
from .pool import BlockPool
from .radix import Match, RadixTree
from .restore import DiskEntry, DiskRestore
from .tree import KVSpan, Node, blocks_for

__all__ = ["ChunkCache", "Match"]


@dataclass(slots=True)
class CacheStats:
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    hit_tokens: int = 0
    moved_hits: int = 0
    moved_tokens: int = 0
    disk_hits: int = 0
    disk_tokens: int = 0
    inserted_tokens: int = 0
    dropped_tokens: int = 0         # new tokens not stored because the budget could not hold them


class ChunkCache:
    """Thread-safe radix tree of KV chunks over a block pool."""

    def __init__(self, fingerprint: bytes, budget_bytes: int, pool: BlockPool, disk=None, disk_codec=None):
        self.fingerprint = fingerprint
        self.pool = pool
        self.block_tokens = pool.block_tokens
        self.index = ContentIndex(fingerprint)
        self.tree = RadixTree(fingerprint, pool, self.index)
        self.budget = CacheBudget(self.tree, budget_bytes)
        self.restore = DiskRestore(disk, pool, fingerprint, disk_codec) if disk is not None else None
        self._lock = threading.RLock()
        self.counters = CacheStats()

    @property
    def budget_bytes(self) -> int:
        return self.budget.budget_bytes

    @property
    def bytes_used(self) -> int:
        return self.budget.bytes_used

    # ---- lookup -------------------------------------------------------------------------
    def match(self, tokens: list[int], limit: int, chunk_ends: list[int] = (), exact_only: bool = False) -> Match:
        """Longest cached prefix of `tokens[:limit]`, token-exact (memory, then disk). `exact_only`:
        up to the first chunk whose KV is an approximation (moved and repaired, or int8 from the disk
        tier: another engine's, sharing the folder), as an engine whose replies must equal no cache's."""
        with self._lock:
            self.counters.lookups += 1
            match, node, offset = self.tree.walk(tokens, limit)
            probe = self.restore is not None and offset < limit and (node is self.tree.root or offset == node.end)
            if probe:                   # read no further than the cache could keep: an entry it cannot hold
                path = [n for span in match.spans for n, _, _ in span.pieces]      # would be read for nothing
                reach = min(limit, self.budget.fitting_end(offset, path))
                probe = reach > offset
            if not probe:               # the table from the same walk, under the same lock
                return self._settle_match(match, offset, tokens, exact_only)
        entries = self.restore.read(tokens, reach, chunk_ends, offset)         # file I/O without the lock
        with self._lock:
            match, node, offset = self.tree.walk(tokens, limit)
            if entries and (node is self.tree.root or offset == node.end):
                path = [n for span in match.spans for n, _, _ in span.pieces]
                self._adopt(entries, tokens, path, offset)
                match, node, offset = self.tree.walk(tokens, limit)
            return self._settle_match(match, offset, tokens, exact_only)

    def _settle_match(self, match: Match, offset: int, tokens: list[int], exact_only: bool) -> Match:
        """The match (cut before its first inexact span where `exact_only`), its block table
        (references for the caller) and the lookup counters (lock held)."""
        inexact = next((span for span in match.spans if not span.exact), None) if exact_only else None
        if inexact is not None and inexact.start < offset:
            self._drop_subtree(inexact.pieces[0][0])       # of no use to this engine: its own exact KV
            match, _, offset = self.tree.walk(tokens, inexact.start)   # for these tokens can take the place
        match.table = self.tree.table_of(match.spans, 0, offset)
        self.counters.hits += bool(match.spans)
        self.counters.misses += not match.spans
        self.counters.hit_tokens += offset
        match.counted = offset
        return match

    def _drop_subtree(self, node) -> None:
        """Evict `node` and what hangs below it, leaves first (pinned chunks and their ancestors stay)."""
        order, stack = [], [node]
        while stack:
            current = stack.pop()
            order.append(current)
            stack.extend(current.children.values())
        for current in reversed(order):                 # every descendant before its ancestors
            if current.alive and not current.children and not current.pinned:
                self.budget.evict(current)

    def cached_prefix(self, tokens: list[int], limit: int, exact: bool = True) -> int:
        """How many of tokens[:limit] are cached as an exact prefix in memory (`exact=False`: exact
        or not); a peek: no counters, no recency, no disk."""
        with self._lock:
            match, _, _ = self.tree.walk(tokens, limit, touch=False)
            return next((span.start for span in match.spans if exact and not span.exact), match.length)

    def release(self, table) -> None:
        """Give back the references a match handed out."""
        self.pool.release([b for b in table if b is not None])

    def give_back(self, match: Match) -> None:
        """A match not used after all (its request computes the prompt whole): its references back, and
        the lookup counted as the miss it became."""
        self.release(match.table)
        with self._lock:
            c = self.counters
            if match.counted:
                c.hits, c.misses, c.hit_tokens, match.counted = c.hits - 1, c.misses + 1, c.hit_tokens - match.counted, 0
        match.table[:], match.spans[:] = [], []

    def match_moved(self, tokens: list[int], chunk_ends: list[int], chunk_kinds: list[str],
                    start: int, limit: int, trim=None) -> list[KVSpan]:
        """Cached KV for content chunks of tokens[start:limit] found elsewhere in the tree, as `trim`
        (the window rule) leaves them, counted as moved hits; each span's `table` holds references for the caller."""
        with self._lock:
            spans = self.index.spans(tokens, chunk_ends, chunk_kinds, start, limit)
            for span in spans:
                for node, _, _ in span.pieces:
                    self.tree.touch(node)
                span.table = self.tree.table_of([span], span.source_start, span.source_start + span.length)
            spans = trim(spans) if trim is not None else spans      # what is dropped there is not counted
            self.counters.moved_hits += len(spans)
            self.counters.moved_tokens += sum(s.length for s in spans)
        return spans

    # ---- insertion ----------------------------------------------------------------------
    def insert(self, tokens: list[int], chunk_ends: list[int], upto: int, source, *, pin: bool = False,
               exact_upto: int | None = None, chunk_kinds: list[str] | None = None) -> int:
        """Store KV for `tokens[:upto]` taken from `source` (a sequence: `cache_blocks(first, end)`
        returns blocks for block indices first.. holding that KV, one reference each).

        New tokens are stored in pieces cut at `chunk_ends` (and at `exact_upto`: KV from there
        on is marked inexact). Content chunks (not template glue or generated text) are indexed
        by content. Returns how many new tokens were stored.
        """
        if self.budget.budget_bytes == 0 or upto <= 0:
            return 0
        tokens = tokens[:upto]
        exact_upto = upto if exact_upto is None else exact_upto
        with self._lock:
            path, offset = self.tree.walk_and_split(tokens)
            if pin:
                self.budget.check_pin(upto, path)
            all_pieces = _pieces(offset, upto, sorted(set(chunk_ends) | {exact_upto}))
            pieces = self.budget.fitting(all_pieces, path)
            if pin and pieces != all_pieces:
                raise BudgetError(f"pinning {upto} tokens does not fit cache_bytes={self.budget.budget_bytes} "
                                  f"next to what is pinned ({self.budget.pinned_bytes} bytes)")
            created = self._attach(path[-1] if path else self.tree.root, tokens, pieces, source, exact_upto)
            self.budget.enforce({n.uid for n in path + created}, created)
            created = [n for n in created if n.alive]
            stored = sum(len(n.tokens) for n in created)
            self.counters.inserted_tokens += stored
            self.counters.dropped_tokens += (upto - offset) - stored
            if chunk_kinds is not None:
                self.index.register(tokens, chunk_ends, chunk_kinds, path + created)
            if pin:
                self.budget.pin(path + created)
            pending = self.restore.pending(created) if self.restore is not None else []
        if pending:
            self.restore.write(pending)                     # file I/O without the lock
        return stored

    def _attach(self, parent: Node, tokens, pieces, source, exact_upto: int) -> list[Node]:
        if not pieces:
            return []
        first_index = pieces[0][0] // self.block_tokens
        if source.allocates:
            self.budget.make_room(len(blocks_for(pieces[0][0], pieces[-1][1], self.block_tokens)), {parent.uid})
        try:
            blocks = source.cache_blocks(first_index, pieces[-1][1])  # one reference each, ours for now
        except BudgetError:
            return []
        try:
            if pieces[0][0] % self.block_tokens and exact_upto < pieces[0][0] and parent.exact:
                blocks[0] = self._private_first_block(parent, blocks[0], pieces[0][0])
            elif first_index in getattr(source, "copied", {}):
                old, upto = source.copied[first_index]
                self.tree.repoint(self.tree.path_nodes(parent), first_index, old, blocks[0], upto)
            return self.tree.link(parent, tokens, pieces, blocks, first_index, exact_upto)
        finally:
            self.pool.release(blocks)

    def _private_first_block(self, parent: Node, shared: int, start: int) -> int:
        """A copy of the first block whose positions before `start` hold the parent path's exact
        KV (the source sequence's own KV there was approximate). Holds one reference."""
        self.budget.make_room(1, {parent.uid})
        try:
            own = self.pool.allocate(1)[0]
        except BudgetError:
            return shared                   # keep the shared block: only telemetry gets coarser
        index = start // self.block_tokens
        head = index * self.block_tokens
        table = [None] * index + [own]
        path = self.tree.path_nodes(parent)
        self.pool.write(table, head, self.pool.read(self.tree.path_table(path, head, start), head, start - head))
        tail = head + self.block_tokens - start
        self.pool.write(table, start, self.pool.read([None] * index + [shared], start, tail))
        self.pool.release([shared])
        return own

    def _adopt(self, entries: list[DiskEntry], tokens, path: list[Node], offset: int) -> None:
        """Bring entries read from disk into the tree for as long as they continue the path (lock held)."""
        for entry in entries:
            if entry.end <= offset:
                continue                                    # another thread stored it meanwhile
            if entry.start > offset:
                return
            node = self._adopt_one(path, tokens, offset, entry.end, entry.kv[:, :, :, offset - entry.start:], entry.exact)
            if node is None:
                return
            path.append(node)
            self.counters.disk_hits += 1
            self.counters.disk_tokens += entry.end - offset
            offset = entry.end

    def _adopt_one(self, path: list[Node], tokens, start: int, end: int, kv, exact: bool) -> Node | None:
        parent = path[-1] if path else self.tree.root
        indices = blocks_for(start, end, self.block_tokens)
        if not self.budget.fitting([(start, end)], path):
            return None                 # (pins taken since the read) it could not stay: evict nothing for it
        self.budget.make_room(len(indices), {n.uid for n in path})
        try:
            blocks = self.pool.allocate(len(indices))
        except BudgetError:
            return None
        table = [None] * indices.start + blocks
        head = indices.start * self.block_tokens
        if head < start:                                # the block also holds the path's earlier positions
            self.pool.write(table, head, self.pool.read(self.tree.path_table(path, head, start), head, start - head))
        self.pool.write(table, start, kv)
        key = PrefixHasher(self.fingerprint)
        key.update(tokens[:end])
        node = self.tree.add(parent, key.key(), tuple(tokens[start:end]), blocks, indices.start, exact)
        self.pool.release(blocks)
        self.budget.enforce({n.uid for n in path} | {node.uid}, [node])
        return node if node.alive else None

    # ---- budget -------------------------------------------------------------------------
    def make_room(self, blocks: int, protected: set[int] = frozenset()) -> None:
        """Evict cached chunks until the pool has `blocks` free blocks (see budget.py)."""
        with self._lock:
            self.budget.make_room(blocks, protected)

    def check_pin_budget(self, tokens: int) -> None:
        """Raise BudgetError unless a pinned prefix of `tokens` positions could fit."""
        with self._lock:
            self.budget.check_pin(tokens)

    # ---- introspection ------------------------------------------------------------------
    def stats(self) -> dict:
        with self._lock:
            c, evicted = self.counters, self.budget.stats
            stats = {
                "lookups": c.lookups, "hits": c.hits, "misses": c.misses, "hit_tokens": c.hit_tokens,
                "moved_hits": c.moved_hits, "moved_tokens": c.moved_tokens,
                "disk_restored_chunks": c.disk_hits, "disk_restored_tokens": c.disk_tokens,
                "inserted_tokens": c.inserted_tokens, "dropped_tokens": c.dropped_tokens,
                "evictions": evicted.evictions, "evicted_bytes": evicted.evicted_bytes,
                "bytes_used": self.bytes_used, "budget_bytes": self.budget.budget_bytes,
                "pinned_bytes": self.budget.pinned_bytes, "nodes": len(self.tree),
                "content_entries": len(self.index),
            }
        return {**stats, **self.pool.stats()}

    def memory(self) -> dict:
        """Bytes held for KV, by holder (the one account of them): the pool (RAM and spill), blocks of
        cached chunks, of running requests (overlapping cached ones they map), only cached (what
        eviction can free), free; pinned chunks and the cache budget; the disk tier."""
        with self._lock:
            blocks = self.pool.usage()
            out = {f"{kind}_bytes": count * self.pool.block_bytes for kind, count in blocks.items()}
            out.update(pool_bytes=self.pool.total_blocks * self.pool.block_bytes,
                       pinned_bytes=self.budget.pinned_bytes, cache_budget_bytes=self.budget.budget_bytes)
        if self.restore is not None:
            disk = self.restore.disk.stats()
            out.update(disk_bytes=disk.get("bytes_used", 0), disk_budget_bytes=disk.get("budget_bytes", 0))
        return out

    def check_invariants(self) -> None:
        """Assert the tree's own invariants (used by tests)."""
        with self._lock:
            self.tree.check()
            assert self.bytes_used <= self.budget.budget_bytes
            self.index.check()


def _pieces(start: int, end: int, chunk_ends: list[int]) -> list[tuple[int, int]]:
    """Cut [start, end) at the chunk boundaries that fall inside it."""
    cuts = [c for c in chunk_ends if start < c < end] + [end]
    pieces, cursor = [], start
    for cut in cuts:
        if cut > cursor:
            pieces.append((cursor, cut))
            cursor = cut
    return pieces
