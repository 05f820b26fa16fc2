"""The chunk cache: a radix tree of token chunks whose KV lives in pool blocks, plus a content index.

- Exact lookup walks the tree by token ids from the root: token-exact prefix reuse, even
  inside a chunk (a partly matched node is split when the new prompt is stored). The result
  is a block table a paged sequence maps without copying.
- Moved lookup finds chunks of content by content key anywhere in the tree (content_index.py)
  and grows each hit over its seams.
- Nodes hold references on their blocks; at most `budget_bytes` of blocks are held by the
  cache (least recently used unpinned leaves go first), and cached blocks are given up when
  running sequences need the room. With a disk tier, new chunks are written through to disk
  and found there again after eviction or a restart.
"""
from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from .cache_disk import DiskRestore
from .content_index import ContentIndex
from .errors import BudgetError
from .hashing import PrefixHasher
from .kv_quant import FloatCodec
from .pool import BlockPool
from .tree import KVSpan, Node, blocks_for, common_prefix

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
    evictions: int = 0
    evicted_bytes: int = 0
    dropped_tokens: int = 0         # new tokens not stored because the budget could not hold them


@dataclass(slots=True)
class Match:
    """The longest cached prefix: spans by exactness, and its block table (retained for the caller)."""

    spans: list[KVSpan] = field(default_factory=list)
    table: list[int] = field(default_factory=list)

    @property
    def length(self) -> int:
        return sum(span.length for span in self.spans)


class ChunkCache(DiskRestore):
    """Thread-safe radix tree of KV chunks over a block pool."""

    def __init__(self, fingerprint: bytes, budget_bytes: int, pool: BlockPool, disk=None, disk_codec=None):
        self.fingerprint = fingerprint
        self.budget_bytes = budget_bytes
        self.pool = pool
        self.disk = disk
        self.disk_codec = disk_codec or FloatCodec()
        self.block_tokens = pool.block_tokens
        self._uids = itertools.count()
        self.root = Node(PrefixHasher(fingerprint).key(), (), [], 0, None, 0, next(self._uids))
        self._lru: OrderedDict[int, Node] = OrderedDict()   # uid -> node, oldest first
        self.index = ContentIndex(fingerprint)
        self._node_refs = np.zeros(pool.total_blocks, dtype=np.int64)
        self._lock = threading.RLock()
        self.pinned_bytes = 0
        self.counters = CacheStats()

    @property
    def bytes_used(self) -> int:
        return int((self._node_refs > 0).sum()) * self.pool.block_bytes

    # ---- lookup -------------------------------------------------------------------------
    def match(self, tokens: list[int], limit: int, chunk_ends: list[int] = ()) -> Match:
        """Longest cached prefix of `tokens[:limit]`, token-exact (memory, then disk)."""
        with self._lock:
            self.counters.lookups += 1
            match, node, offset = self._walk(tokens, limit)
            probe = self.disk is not None and offset < limit and (node is self.root or offset == node.end)
        if probe:
            entries = self._read_disk(tokens, limit, chunk_ends, offset)     # file I/O without the lock
        with self._lock:
            if probe:
                match, node, offset = self._walk(tokens, limit)
                if entries and (node is self.root or offset == node.end):
                    path = [n for span in match.spans for n, _, _ in span.pieces]
                    self._adopt_entries(entries, tokens, path, offset)
                    match, node, offset = self._walk(tokens, limit)
            match.table = self._table_of(match.spans, 0, offset)
            self.counters.hits += bool(match.spans)
            self.counters.misses += not match.spans
            self.counters.hit_tokens += offset
        return match

    def _walk(self, tokens, limit) -> tuple[Match, Node, int]:
        match, node, offset = Match(), self.root, 0
        while offset < limit:
            child = node.children.get(tokens[offset])
            if child is None:
                break
            used = common_prefix(child.tokens[:limit - offset], tokens, offset)
            self._touch(child)
            if not match.spans or match.spans[-1].exact != child.exact:
                match.spans.append(KVSpan(offset, 0, offset, child.exact))
            match.spans[-1].pieces.append((child, 0, used))
            match.spans[-1].length += used
            offset += used
            node = child
            if used < len(child.tokens):
                break
        return match, node, offset

    def _table_of(self, spans: list[KVSpan], first: int, end: int) -> list:
        """Block table for source positions [first, end) of the span pieces, retained once per entry."""
        table = self._path_table([node for span in spans for node, _, _ in span.pieces], first, end)
        self.pool.retain([b for b in table if b is not None])
        return table

    def _path_table(self, nodes: list[Node], first: int, end: int) -> list:
        """Blocks of positions [first, end) along consecutive path nodes (later nodes win a shared block)."""
        table: list = [None] * len(blocks_for(0, end, self.block_tokens))
        for node in nodes:
            for index, block in zip(range(node.first_block, node.first_block + len(node.blocks)), node.blocks):
                if first // self.block_tokens <= index < len(table):
                    table[index] = block
        return table

    def release(self, table) -> None:
        """Give back the references a match handed out."""
        self.pool.release([b for b in table if b is not None])

    def match_moved(self, tokens: list[int], chunk_ends: list[int], chunk_kinds: list[str],
                    start: int, limit: int) -> list[KVSpan]:
        """Cached KV for content chunks of tokens[start:limit] found elsewhere in the tree;
        each span's `table` holds references for the caller."""
        with self._lock:
            spans = self.index.spans(tokens, chunk_ends, chunk_kinds, start, limit)
            for span in spans:
                for node, _, _ in span.pieces:
                    self._touch(node)
                span.table = self._table_of([span], span.source_start, span.source_start + span.length)
            self.counters.moved_hits += len(spans)
            self.counters.moved_tokens += sum(s.length for s in spans)
        return spans

    def _touch(self, node: Node) -> None:
        node.hits += 1
        self._lru.move_to_end(node.uid)

    # ---- insertion ----------------------------------------------------------------------
    def insert(self, tokens: list[int], chunk_ends: list[int], upto: int, source, *, pin: bool = False,
               exact_upto: int | None = None, chunk_kinds: list[str] | None = None) -> int:
        """Store KV for `tokens[:upto]` taken from `source` (a sequence: `cache_blocks(first, end)`
        returns blocks for block indices first.. holding that KV, one reference each).

        New tokens are stored in pieces cut at `chunk_ends` (and at `exact_upto`: KV from there
        on is marked inexact). Content chunks (not template glue or generated text) are indexed
        by content.
        Returns how many new tokens were stored.
        """
        if self.budget_bytes == 0 or upto <= 0:
            return 0
        tokens = tokens[:upto]
        exact_upto = upto if exact_upto is None else exact_upto
        with self._lock:
            path, offset = self._walk_and_split(tokens)
            if pin:
                self.check_pin_budget(upto, path)
            all_pieces = _pieces(offset, upto, sorted(set(chunk_ends) | {exact_upto}))
            pieces = self._fitting(all_pieces, path)
            if pin and pieces != all_pieces:
                raise BudgetError(f"pinning {upto} tokens does not fit cache_bytes={self.budget_bytes} "
                                  f"next to what is pinned ({self.pinned_bytes} bytes)")
            created = self._attach(path[-1] if path else self.root, tokens, pieces, source, exact_upto)
            self._fit_budget({n.uid for n in path + created}, created)
            created = [n for n in created if n.alive]
            stored = sum(len(n.tokens) for n in created)
            self.counters.inserted_tokens += stored
            self.counters.dropped_tokens += (upto - offset) - stored
            if chunk_kinds is not None:
                self.index.register(tokens, chunk_ends, chunk_kinds, path + created)
            if pin:
                self._pin(path + created)
            pending = self._hold_for_disk(created) if self.disk is not None else []
        self._write_through(pending)                    # file I/O without the lock
        return stored

    def _walk_and_split(self, tokens: list[int]) -> tuple[list[Node], int]:
        """Follow fully matching nodes; split a partly matching one. Returns (path, matched)."""
        path: list[Node] = []
        node, offset = self.root, 0
        while offset < len(tokens):
            child = node.children.get(tokens[offset])
            if child is None:
                break
            used = common_prefix(child.tokens, tokens, offset)
            if used < len(child.tokens):
                child = self._split(child, used)
            self._touch(child)
            path.append(child)
            offset += used
            node = child
        return path, offset

    def _split(self, node: Node, at: int) -> Node:
        """Cut `node` after `at` tokens; returns the new head (which keeps the parent link)."""
        hasher = PrefixHasher(self.fingerprint)
        hasher.update(self._prefix_tokens(node.parent) + list(node.tokens[:at]))
        cut = node.start + at
        head_indices = blocks_for(node.start, cut, self.block_tokens)
        head_blocks = node.blocks[:len(head_indices)]
        self._hold(head_blocks)
        head = Node(hasher.key(), node.tokens[:at], head_blocks, node.first_block, node.parent, node.start,
                    next(self._uids), node.exact)
        node.parent.children[head.tokens[0]] = head
        tail_first = cut // self.block_tokens
        self._drop(node.blocks[:tail_first - node.first_block])
        node.blocks = node.blocks[tail_first - node.first_block:]
        node.first_block = tail_first
        node.tokens = node.tokens[at:]
        node.start = cut
        node.parent = head
        head.children[node.tokens[0]] = node
        head.pinned, head.hits = node.pinned, node.hits
        self.index.split(node, head, at)
        self._lru[head.uid] = head
        return head

    def _prefix_tokens(self, node: Node) -> list[int]:
        chain = []
        while node is not None and node is not self.root:
            chain.append(node.tokens)
            node = node.parent
        return [t for part in reversed(chain) for t in part]

    def _attach(self, parent: Node, tokens, pieces, source, exact_upto: int) -> list[Node]:
        if not pieces:
            return []
        first_index = pieces[0][0] // self.block_tokens
        if source.allocates:
            self.make_room(len(blocks_for(pieces[0][0], pieces[-1][1], self.block_tokens)), {parent.uid})
        try:
            blocks = source.cache_blocks(first_index, pieces[-1][1])  # one reference each, ours for now
        except BudgetError:
            return []
        try:
            if pieces[0][0] % self.block_tokens and exact_upto < pieces[0][0] and parent.exact:
                blocks[0] = self._private_first_block(parent, blocks[0], pieces[0][0])
            return self._link(parent, tokens, pieces, blocks, first_index, exact_upto)
        finally:
            self.pool.release(blocks)

    def _private_first_block(self, parent: Node, shared: int, start: int) -> int:
        """A copy of the first block whose positions before `start` hold the parent path's exact
        KV (the source sequence's own KV there was approximate). Holds one reference."""
        self.make_room(1, {parent.uid})
        try:
            own = self.pool.allocate(1)[0]
        except BudgetError:
            return shared                   # keep the shared block: only telemetry gets coarser
        index = start // self.block_tokens
        head = index * self.block_tokens
        table = [None] * index + [own]
        path = self._path_nodes(parent)
        self.pool.write(table, head, self.pool.read(self._path_table(path, head, start), head, start - head))
        tail = head + self.block_tokens - start
        self.pool.write(table, start, self.pool.read([None] * index + [shared], start, tail))
        self.pool.release([shared])
        return own

    def _path_nodes(self, node: Node) -> list[Node]:
        chain = []
        while node is not None and node is not self.root:
            chain.append(node)
            node = node.parent
        return chain[::-1]

    def _link(self, parent: Node, tokens, pieces, blocks, first_index: int, exact_upto: int) -> list[Node]:
        hasher = PrefixHasher(self.fingerprint)
        hasher.update(tokens[:pieces[0][0]])
        created = []
        for start, end in pieces:
            indices = blocks_for(start, end, self.block_tokens)
            node_blocks = blocks[indices.start - first_index:indices.stop - first_index]
            self._hold(node_blocks)
            hasher.update(tokens[start:end])
            node = Node(hasher.key(), tuple(tokens[start:end]), node_blocks, indices.start, parent, start,
                        next(self._uids), exact=end <= exact_upto and parent.exact)
            parent.children[node.tokens[0]] = node
            self._lru[node.uid] = node
            created.append(node)
            parent = node
        return created

    def _fitting(self, pieces: list[tuple[int, int]], path: list[Node]) -> list[tuple[int, int]]:
        """The leading pieces whose blocks fit the budget next to pinned chunks and the path."""
        kept = {b for n in self._lru.values() if n.pinned for b in n.blocks} | {b for n in path for b in n.blocks}
        room = self.budget_bytes // self.pool.block_bytes - len(kept)
        fitting = [piece for piece in pieces
                   if len(blocks_for(pieces[0][0], piece[1], self.block_tokens)) <= room]
        return fitting

    def _hold(self, blocks: list[int]) -> None:
        self.pool.retain(blocks)
        np.add.at(self._node_refs, np.asarray(blocks, dtype=np.int64), 1)

    def _drop(self, blocks: list[int]) -> None:
        np.subtract.at(self._node_refs, np.asarray(blocks, dtype=np.int64), 1)
        self.pool.release(blocks)

    # ---- budget -------------------------------------------------------------------------
    def _fit_budget(self, protected: set[int], created: list[Node]) -> None:
        """Evict old leaves until the cache holds at most its budget; if that is not enough,
        give up the newest of the nodes just created."""
        while self.bytes_used > self.budget_bytes:
            victim = self._oldest_leaf(protected)
            if victim is None:
                break
            self._remove(victim)
        for node in reversed(created):
            if self.bytes_used <= self.budget_bytes:
                break
            if not node.children and not node.pinned:
                self._remove(node, evicted=False)       # never stored, not an eviction

    def _oldest_leaf(self, protected: set[int]) -> Node | None:
        return next((n for n in self._lru.values()
                     if not n.children and not n.pinned and n.uid not in protected), None)

    def make_room(self, blocks: int, protected: set[int] = frozenset()) -> None:
        """Evict cached chunks until the pool has `blocks` free blocks (for a running sequence).

        Only chunks whose blocks nothing else holds are evicted (dropping a chunk that a running
        sequence shares frees nothing), and nothing at all when eviction could not free enough:
        a request that will be refused anyway leaves the cache as it was.
        """
        with self._lock:
            missing = blocks - self.pool.free_blocks()
            if missing <= 0:
                return
            pinned = {b for n in self._lru.values() if n.pinned for b in n.blocks}
            only_cached = np.flatnonzero((self._node_refs > 0) & (self._node_refs == self.pool.refs))
            if len(set(only_cached.tolist()) - pinned) < missing:
                return
            while self.pool.free_blocks() < blocks:
                victim = next((n for n in self._lru.values() if not n.children and not n.pinned
                               and n.uid not in protected and self._frees_blocks(n)), None)
                if victim is None:
                    return
                self._remove(victim)

    def _frees_blocks(self, node: Node) -> bool:
        blocks = np.asarray(node.blocks, dtype=np.int64)
        return bool(((self.pool.refs[blocks] == 1) & (self._node_refs[blocks] == 1)).any())

    def _remove(self, node: Node, evicted: bool = True) -> None:
        del node.parent.children[node.tokens[0]]
        del self._lru[node.uid]
        self.index.remove(node)
        freed = len(node.blocks) * self.pool.block_bytes
        self._drop(node.blocks)
        node.blocks = []
        node.alive = False
        if evicted:
            self.counters.evictions += 1
            self.counters.evicted_bytes += freed

    def check_pin_budget(self, tokens: int, path: list[Node] = ()) -> None:
        """Raise BudgetError unless a pinned prefix of `tokens` positions fits next to what is pinned."""
        need = self.pinned_bytes + sum(len(n.blocks) * self.pool.block_bytes for n in path if not n.pinned)
        start = path[-1].end if path else 0
        need += len(blocks_for(start, tokens, self.block_tokens)) * self.pool.block_bytes
        if need > self.budget_bytes:
            raise BudgetError(f"pinning needs {need} bytes of KV but cache_bytes is {self.budget_bytes} "
                              f"(already pinned: {self.pinned_bytes})")

    def _pin(self, nodes: list[Node]) -> None:
        for node in nodes:
            if not node.pinned and node.alive:
                node.pinned = True
                self.pinned_bytes += len(node.blocks) * self.pool.block_bytes

    def unpin_all(self) -> None:
        with self._lock:
            for node in self._lru.values():
                node.pinned = False
            self.pinned_bytes = 0

    # ---- introspection ------------------------------------------------------------------
    def stats(self) -> dict:
        with self._lock:
            c = self.counters
            stats = {
                "lookups": c.lookups, "hits": c.hits, "misses": c.misses, "hit_tokens": c.hit_tokens,
                "moved_hits": c.moved_hits, "moved_tokens": c.moved_tokens,
                "disk_restored_chunks": c.disk_hits, "disk_restored_tokens": c.disk_tokens,
                "inserted_tokens": c.inserted_tokens, "dropped_tokens": c.dropped_tokens,
                "evictions": c.evictions, "evicted_bytes": c.evicted_bytes,
                "bytes_used": self.bytes_used, "budget_bytes": self.budget_bytes,
                "pinned_bytes": self.pinned_bytes, "nodes": len(self._lru),
                "content_entries": len(self.index),
            }
        return {**stats, **self.pool.stats()}

    def check_invariants(self) -> None:
        """Assert the tree's own invariants (used by tests)."""
        with self._lock:
            refs = np.zeros_like(self._node_refs)
            for node in self._lru.values():
                assert node.alive and node.parent.children[node.tokens[0]] is node
                assert node.start == node.parent.end
                assert range(node.first_block, node.first_block + len(node.blocks)) == \
                    blocks_for(node.start, node.end, self.block_tokens)
                assert node.exact or not any(c.exact for c in node.children.values())
                np.add.at(refs, np.asarray(node.blocks, dtype=np.int64), 1)
            assert (refs == self._node_refs).all()
            assert (self.pool.refs >= self._node_refs).all()
            assert self.bytes_used <= self.budget_bytes
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
