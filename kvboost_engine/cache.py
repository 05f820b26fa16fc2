"""The chunk cache: a radix tree of KV chunks under a hard byte budget, plus a content index.

- Exact lookup walks the tree by token ids from the root: token-exact prefix reuse, even
  inside a chunk (a partly matched node is split when the new prompt is stored).
- Moved lookup finds chunks of documents / plain text by content key anywhere in the tree,
  then grows each hit left and right token by token along the source path, so a document
  reused at another position or order is found whole, seams included.
- Eviction drops least recently used unpinned leaves until new KV fits the budget.
"""
from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
import xxhash

from .errors import BudgetError
from .hashing import PrefixHasher, token_bytes
from .tree import KVSpan, Node, common_prefix, locate, walk_back, walk_forward

CONTENT_KINDS = frozenset({"document", "text"})


@dataclass(slots=True)
class CacheStats:
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    hit_tokens: int = 0
    moved_hits: int = 0
    moved_tokens: int = 0
    inserted_tokens: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    dropped_tokens: int = 0         # new tokens not stored because the budget could not hold them


class ChunkCache:
    """Thread-safe radix tree of KV chunks with LRU eviction of unpinned leaves."""

    def __init__(self, fingerprint: bytes, budget_bytes: int, bytes_per_token: int):
        self.fingerprint = fingerprint
        self.budget_bytes = budget_bytes
        self.bytes_per_token = bytes_per_token
        self._uids = itertools.count()
        self.root = Node(PrefixHasher(fingerprint).key(), (), None, None, 0, next(self._uids))
        self._lru: OrderedDict[int, Node] = OrderedDict()   # uid -> node, oldest first
        self._by_key: dict[bytes, Node] = {}
        self._content: dict[bytes, tuple[Node, int]] = {}   # content key -> where that chunk starts
        self._lock = threading.Lock()
        self.bytes_used = 0
        self.pinned_bytes = 0
        self.counters = CacheStats()

    def content_key(self, token_ids) -> bytes:
        return xxhash.xxh3_128_digest(self.fingerprint + b"content" + token_bytes(token_ids))

    # ---- lookup -------------------------------------------------------------------------
    def match(self, tokens: list[int], limit: int | None = None) -> list[KVSpan]:
        """Longest cached prefix of `tokens[:limit]`, token-exact: one span per run of nodes
        with the same exactness."""
        limit = len(tokens) if limit is None else limit
        with self._lock:
            self.counters.lookups += 1
            spans: list[KVSpan] = []
            node, offset = self.root, 0
            while offset < limit:
                child = node.children.get(tokens[offset])
                if child is None:
                    break
                used = common_prefix(child.tokens[:limit - offset], tokens, offset)
                self._touch(child)
                if not spans or spans[-1].exact != child.exact:
                    spans.append(KVSpan(offset, 0, offset, child.exact))
                spans[-1].pieces.append((child.kv, 0, used))
                spans[-1].length += used
                offset += used
                if used < len(child.tokens):
                    break
                node = child
            self.counters.hits += bool(spans)
            self.counters.misses += not spans
            self.counters.hit_tokens += offset
        return spans

    def match_moved(self, tokens: list[int], chunk_ends: list[int], chunk_kinds: list[str],
                    start: int, limit: int) -> list[KVSpan]:
        """Cached KV for document/plain-text chunks of tokens[start:limit] found elsewhere."""
        spans: list[KVSpan] = []
        floor = start
        with self._lock:
            chunk_start = 0
            for end, kind in zip(chunk_ends, chunk_kinds):
                begin, chunk_start = chunk_start, end
                if kind not in CONTENT_KINDS or begin < floor or end > limit:
                    continue
                span = self._grow(tokens, begin, end, floor, limit)
                if span is not None:
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
        node, offset, added = walk_back(node, offset, tokens, begin, floor)
        first = begin - added
        length, pieces, exact = walk_forward(node, offset, tokens, first, limit)
        for kv_node in self._nodes_of(node, offset, length, tokens, first):
            self._touch(kv_node)
        return KVSpan(first, length, node.start + offset, exact, pieces)

    def _nodes_of(self, node: Node, offset: int, length: int, tokens, first: int):
        covered = 0
        while covered < length:
            yield node
            covered += len(node.tokens) - offset
            if covered < length:
                node, offset = node.children[tokens[first + covered]], 0

    def _touch(self, node: Node) -> None:
        node.hits += 1
        self._lru.move_to_end(node.uid)

    # ---- insertion ----------------------------------------------------------------------
    def insert(self, tokens: list[int], chunk_ends: list[int], upto: int,
               kv_slice: Callable[[int, int], torch.Tensor], *, pin: bool = False,
               exact_upto: int | None = None, chunk_kinds: list[str] | None = None) -> int:
        """Store KV for `tokens[:upto]`; `kv_slice(start, end)` returns a compact copy.

        New tokens are stored in pieces cut at `chunk_ends` (and at `exact_upto`: KV from
        there on is marked inexact). Chunks whose kind is document/text are indexed by
        content. Returns how many new tokens were stored (fewer when the budget is full).
        """
        if self.budget_bytes == 0 or upto <= 0:
            return 0
        tokens = tokens[:upto]
        exact_upto = upto if exact_upto is None else exact_upto
        with self._lock:
            path, offset = self._walk_and_split(tokens)
            pieces = _pieces(offset, upto, sorted(set(chunk_ends) | {exact_upto}))
            need = (upto - offset) * self.bytes_per_token
            if pin:
                self._check_pin_budget(path, need)
            room = self.budget_bytes - self.pinned_bytes - sum(n.nbytes for n in path if not n.pinned)
            self._evict(min(need, max(room, 0)), {n.uid for n in path})
            new_nodes = self._attach(path[-1] if path else self.root, tokens, pieces, kv_slice, exact_upto)
            stored = sum(len(n.tokens) for n in new_nodes)
            self.counters.inserted_tokens += stored
            self.counters.dropped_tokens += (upto - offset) - stored
            if chunk_kinds is not None:
                self._index_content(tokens, chunk_ends, chunk_kinds, path + new_nodes)
            if pin:
                self._pin(path + new_nodes)
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
        head = Node(hasher.key(), node.tokens[:at], node.kv[:, :, :, :at].clone(), node.parent,
                    node.start, next(self._uids), node.exact)
        node.parent.children[head.tokens[0]] = head
        node.tokens = node.tokens[at:]
        node.kv = node.kv[:, :, :, at:].clone()
        node.start += at
        node.parent = head
        head.children[node.tokens[0]] = node
        head.pinned, head.hits = node.pinned, node.hits
        refs, node.content_refs = node.content_refs, []
        for key, off in refs:
            target, target_off = (head, off) if off < at else (node, off - at)
            target.content_refs.append((key, target_off))
            if self._content.get(key, (None,))[0] is node:
                self._content[key] = (target, target_off)
        self._by_key[head.key] = head
        self._lru[head.uid] = head
        return head

    def _prefix_tokens(self, node: Node) -> list[int]:
        chain = []
        while node is not None and node is not self.root:
            chain.append(node.tokens)
            node = node.parent
        return [t for part in reversed(chain) for t in part]

    def _attach(self, parent: Node, tokens, pieces, kv_slice, exact_upto: int) -> list[Node]:
        hasher = PrefixHasher(self.fingerprint)
        hasher.update(tokens[:pieces[0][0]] if pieces else [])
        created = []
        for start, end in pieces:
            kv = kv_slice(start, end)
            nbytes = kv.numel() * kv.element_size()
            if self.bytes_used + nbytes > self.budget_bytes:
                break
            hasher.update(tokens[start:end])
            node = Node(hasher.key(), tuple(tokens[start:end]), kv, parent, start, next(self._uids),
                        exact=end <= exact_upto and parent.exact)
            parent.children[node.tokens[0]] = node
            self._by_key[node.key] = node
            self._lru[node.uid] = node
            self.bytes_used += nbytes
            created.append(node)
            parent = node
        return created

    def _index_content(self, tokens, chunk_ends, chunk_kinds, path: list[Node]) -> None:
        begin = 0
        for end, kind in zip(chunk_ends, chunk_kinds):
            chunk_begin, begin = begin, end
            if kind not in CONTENT_KINDS or end > (path[-1].end if path else 0):
                continue
            where = locate(path, chunk_begin)
            key = self.content_key(tokens[chunk_begin:end])
            known = self._content.get(key)
            if where is None or (known is not None and known[0].kv is not None
                                 and (known[0].exact or not where[0].exact)):
                continue
            self._content[key] = where
            where[0].content_refs.append((key, where[1]))

    # ---- budget -------------------------------------------------------------------------
    def _evict(self, need: int, protected: set[int]) -> None:
        while self.bytes_used + need > self.budget_bytes:
            victim = next((n for n in self._lru.values()
                           if not n.children and not n.pinned and n.uid not in protected), None)
            if victim is None:
                return
            self._remove(victim)

    def _remove(self, node: Node) -> None:
        del node.parent.children[node.tokens[0]]
        del self._lru[node.uid]
        self._by_key.pop(node.key, None)
        for key, _ in node.content_refs:
            if self._content.get(key, (None,))[0] is node:
                del self._content[key]
        self.bytes_used -= node.nbytes
        self.counters.evictions += 1
        self.counters.evicted_bytes += node.nbytes
        node.kv = None

    def _check_pin_budget(self, path: list[Node], need: int) -> None:
        unpinned_path = sum(n.nbytes for n in path if not n.pinned)
        if self.pinned_bytes + unpinned_path + need > self.budget_bytes:
            raise BudgetError(
                f"pinning needs {self.pinned_bytes + unpinned_path + need} bytes of KV but cache_bytes is "
                f"{self.budget_bytes} (already pinned: {self.pinned_bytes})"
            )

    def _pin(self, nodes: list[Node]) -> None:
        for node in nodes:
            if not node.pinned:
                node.pinned = True
                self.pinned_bytes += node.nbytes

    def unpin_all(self) -> None:
        with self._lock:
            for node in self._lru.values():
                node.pinned = False
            self.pinned_bytes = 0

    # ---- introspection ------------------------------------------------------------------
    def get(self, key: bytes) -> Node | None:
        with self._lock:
            return self._by_key.get(key)

    def stats(self) -> dict:
        with self._lock:
            c = self.counters
            return {
                "lookups": c.lookups, "hits": c.hits, "misses": c.misses, "hit_tokens": c.hit_tokens,
                "moved_hits": c.moved_hits, "moved_tokens": c.moved_tokens,
                "inserted_tokens": c.inserted_tokens, "dropped_tokens": c.dropped_tokens,
                "evictions": c.evictions, "evicted_bytes": c.evicted_bytes,
                "bytes_used": self.bytes_used, "budget_bytes": self.budget_bytes,
                "pinned_bytes": self.pinned_bytes, "nodes": len(self._lru),
                "content_entries": len(self._content),
            }

    def check_invariants(self) -> None:
        """Assert the tree's own invariants (used by tests)."""
        with self._lock:
            total = 0
            for node in self._lru.values():
                assert node.parent.children[node.tokens[0]] is node
                assert node.start == node.parent.end
                assert node.kv.shape[3] == len(node.tokens)
                assert node.exact or not any(c.exact for c in node.children.values())
                total += node.nbytes
            assert total == self.bytes_used <= self.budget_bytes
            for key, (node, offset) in self._content.items():
                assert node.kv is not None and (key, offset) in node.content_refs


def _pieces(start: int, end: int, chunk_ends: list[int]) -> list[tuple[int, int]]:
    """Cut [start, end) at the chunk boundaries that fall inside it."""
    cuts = [c for c in chunk_ends if start < c < end] + [end]
    pieces, cursor = [], start
    for cut in cuts:
        if cut > cursor:
            pieces.append((cursor, cut))
            cursor = cut
    return pieces
