"""The chunk cache: a radix tree of token chunks whose KV lives in pool blocks, plus a content index.

- Exact lookup walks the tree by token ids from the root: token-exact prefix reuse, even
  inside a chunk (a partly matched node is split when the new prompt is stored). The result
  is a block table a paged sequence maps without copying.
- Moved lookup finds chunks of documents / plain text by content key anywhere in the tree,
  then grows each hit left and right token by token along the source path, so a document
  reused at another position or order is found whole, seams included.
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
import xxhash

from .errors import BudgetError
from .hashing import PrefixHasher, token_bytes
from .pool import BlockPool
from .tree import KVSpan, Node, blocks_for, common_prefix, locate, walk_back, walk_forward

# Chunks of every kind of content are indexed by content (documents inside one system or user
# string of an unmodified chain included); template glue and generated tokens are not.
NOT_CONTENT = frozenset({"glue", "generated"})


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


class ChunkCache:
    """Thread-safe radix tree of KV chunks over a block pool."""

    def __init__(self, fingerprint: bytes, budget_bytes: int, pool: BlockPool, disk=None):
        self.fingerprint = fingerprint
        self.budget_bytes = budget_bytes
        self.pool = pool
        self.disk = disk
        self.block_tokens = pool.block_tokens
        self._uids = itertools.count()
        self.root = Node(PrefixHasher(fingerprint).key(), (), [], 0, None, 0, next(self._uids))
        self._lru: OrderedDict[int, Node] = OrderedDict()   # uid -> node, oldest first
        self._content: dict[bytes, tuple[Node, int]] = {}   # content key -> where that chunk starts
        self._node_refs = np.zeros(pool.total_blocks, dtype=np.int64)
        self._lock = threading.RLock()
        self.pinned_bytes = 0
        self.counters = CacheStats()

    @property
    def bytes_used(self) -> int:
        return int((self._node_refs > 0).sum()) * self.pool.block_bytes

    def content_key(self, token_ids) -> bytes:
        return xxhash.xxh3_128_digest(self.fingerprint + b"content" + token_bytes(token_ids))

    # ---- lookup -------------------------------------------------------------------------
    def match(self, tokens: list[int], limit: int, chunk_ends: list[int] = ()) -> Match:
        """Longest cached prefix of `tokens[:limit]`, token-exact (memory, then disk)."""
        with self._lock:
            self.counters.lookups += 1
            match, node, offset = self._walk(tokens, limit)
            if self.disk is not None and offset < limit and (node is self.root or offset == node.end):
                path = [n for span in match.spans for n, _, _ in span.pieces]
                self._restore_from_disk(tokens, limit, chunk_ends, path, offset)
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
        """Cached KV for content chunks of tokens[start:limit] found elsewhere in the tree."""
        spans: list[KVSpan] = []
        floor = start
        with self._lock:
            chunk_start = 0
            for end, kind in zip(chunk_ends, chunk_kinds):
                begin, chunk_start = chunk_start, end
                if kind in NOT_CONTENT or end <= floor or end > limit:
                    continue
                span = self._grow(tokens, begin, end, floor, limit)
                if span is not None:
                    span.table = self._table_of([span], span.source_start, span.source_start + span.length)
                    spans.append(span)
                    floor = span.start + span.length
            self.counters.moved_hits += len(spans)
            self.counters.moved_tokens += sum(s.length for s in spans)
        return spans

    def _grow(self, tokens, begin: int, end: int, floor: int, limit: int) -> KVSpan | None:
        found = self._content.get(self.content_key(tokens[begin:end]))
        if found is None:
            return None
        node, offset = found
        matched, _, _ = walk_forward(node, offset, tokens, begin, end)
        if matched != end - begin:                      # compare the tokens on every hit
            return None
        if begin < floor:
            # The previous span already covers the chunk's head (tokens that happened to match
            # past its seam): continue from where it ended.
            _, covered, _ = walk_forward(node, offset, tokens, begin, floor)
            last, last_offset, last_count = covered[-1]
            node, offset, first = last, last_offset + last_count, floor
        else:
            node, offset, added = walk_back(node, offset, tokens, begin, floor)
            first = begin - added
        length, pieces, exact = walk_forward(node, offset, tokens, first, limit)
        if length == 0:
            return None
        for piece_node, _, _ in pieces:
            self._touch(piece_node)
        return KVSpan(first, length, node.start + offset, exact, pieces)

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
                self._check_pin_budget(path, upto - offset)
            pieces = self._fitting(_pieces(offset, upto, sorted(set(chunk_ends) | {exact_upto})), path)
            created = self._attach(path[-1] if path else self.root, tokens, pieces, source, exact_upto)
            self._fit_budget({n.uid for n in path + created}, created)
            created = [n for n in created if n.alive]
            stored = sum(len(n.tokens) for n in created)
            self.counters.inserted_tokens += stored
            self.counters.dropped_tokens += (upto - offset) - stored
            if chunk_kinds is not None:
                self._index_content(tokens, chunk_ends, chunk_kinds, path + created)
            if pin:
                self._pin(path + created)
            if self.disk is not None:
                for node in created:
                    self._write_through(node)
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
        self._move_content_refs(node, head, at)
        self._lru[head.uid] = head
        return head

    def _move_content_refs(self, tail: Node, head: Node, at: int) -> None:
        refs, tail.content_refs = tail.content_refs, []
        for key, off in refs:
            target, target_off = (head, off) if off < at else (tail, off - at)
            target.content_refs.append((key, target_off))
            if self._content.get(key, (None,))[0] is tail:
                self._content[key] = (target, target_off)

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
        self.pool.release(blocks)
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

    def _index_content(self, tokens, chunk_ends, chunk_kinds, path: list[Node]) -> None:
        begin = 0
        for end, kind in zip(chunk_ends, chunk_kinds):
            chunk_begin, begin = begin, end
            if kind in NOT_CONTENT or end > (path[-1].end if path else 0):
                continue
            where = locate(path, chunk_begin)
            key = self.content_key(tokens[chunk_begin:end])
            known = self._content.get(key)
            if where is None or (known is not None and known[0].alive and (known[0].exact or not where[0].exact)):
                continue
            self._content[key] = where
            where[0].content_refs.append((key, where[1]))

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
        """Evict cached chunks until the pool has `blocks` free blocks (for a running sequence)."""
        with self._lock:
            while self.pool.free_blocks() < blocks:
                victim = self._oldest_leaf(protected)
                if victim is None:
                    return
                self._remove(victim)

    def _remove(self, node: Node, evicted: bool = True) -> None:
        del node.parent.children[node.tokens[0]]
        del self._lru[node.uid]
        for key, _ in node.content_refs:
            if self._content.get(key, (None,))[0] is node:
                del self._content[key]
        freed = len(node.blocks) * self.pool.block_bytes
        self._drop(node.blocks)
        node.blocks = []
        node.alive = False
        if evicted:
            self.counters.evictions += 1
            self.counters.evicted_bytes += freed

    def _check_pin_budget(self, path: list[Node], new_tokens: int) -> None:
        need = self.pinned_bytes + sum(len(n.blocks) * self.pool.block_bytes for n in path if not n.pinned)
        need += new_tokens * self.pool.block_bytes // self.block_tokens
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

    # ---- disk tier ----------------------------------------------------------------------
    def _write_through(self, node: Node) -> None:
        if not self.disk.contains(node.key):
            kv = self.read(node, 0, len(node.tokens))
            self.disk.put_async(node.key, node.start, node.tokens, kv, node.exact)

    def read(self, node: Node, offset: int, count: int):
        """KV of `count` of a node's positions from `offset`: [2, layers, kv_heads, count, D] (a copy)."""
        table = [None] * node.first_block + node.blocks
        return self.pool.read(table, node.start + offset, count)

    def _restore_from_disk(self, tokens, limit, chunk_ends, path: list[Node], offset: int) -> None:
        """Bring chunks back from disk, in order, for as long as they continue the matched path."""
        hasher = PrefixHasher(self.fingerprint)
        hasher.update(tokens[:offset])
        cursor = offset
        for end in (c for c in chunk_ends if offset < c <= limit):
            hasher.update(tokens[cursor:end])
            cursor = end
            entry = self.disk.get(hasher.key())
            if entry is None:
                return
            start, entry_tokens, kv, exact = entry
            if start > offset or tuple(tokens[start:end]) != tuple(entry_tokens):
                return
            node = self._adopt_disk_entry(path, tokens, offset, end, kv[:, :, :, offset - start:], exact)
            if node is None:
                return
            path.append(node)
            self.counters.disk_hits += 1
            self.counters.disk_tokens += end - offset
            offset = end

    def _adopt_disk_entry(self, path: list[Node], tokens, start: int, end: int, kv, exact: bool) -> Node | None:
        parent = path[-1] if path else self.root
        indices = blocks_for(start, end, self.block_tokens)
        self.make_room(len(indices), {n.uid for n in path})
        try:
            blocks = self.pool.allocate(len(indices))
        except BudgetError:
            return None
        table = [None] * indices.start + blocks
        head = indices.start * self.block_tokens
        if head < start:                                # the block also holds the path's earlier positions
            self.pool.write(table, head, self.pool.read(self._path_table(path, head, start), head, start - head))
        self.pool.write(table, start, kv)
        self._hold(blocks)
        self.pool.release(blocks)
        key = PrefixHasher(self.fingerprint)
        key.update(tokens[:end])
        node = Node(key.key(), tuple(tokens[start:end]), blocks, indices.start, parent, start, next(self._uids),
                    exact=exact and parent.exact)
        parent.children[node.tokens[0]] = node
        self._lru[node.uid] = node
        self._fit_budget({n.uid for n in path} | {node.uid}, [])
        return node

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
                "content_entries": len(self._content),
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
            for key, (node, offset) in self._content.items():
                assert node.alive and (key, offset) in node.content_refs


def _pieces(start: int, end: int, chunk_ends: list[int]) -> list[tuple[int, int]]:
    """Cut [start, end) at the chunk boundaries that fall inside it."""
    cuts = [c for c in chunk_ends if start < c < end] + [end]
    pieces, cursor = [], start
    for cut in cuts:
        if cut > cursor:
            pieces.append((cursor, cut))
            cursor = cut
    return pieces
