"""The chunk cache: a radix tree of token chunks with their KV, under a hard byte budget.

Each node holds the KV of a run of tokens, valid only after exactly the tokens on the path
from the root (exact-prefix reuse). Lookup walks the tree by token ids, so reuse is
token-exact: it stops at the first token that differs from everything cached, even inside a
chunk. A node that is only partly matched is split at insertion time. Each node also carries
the key of its whole prefix (xxh3-128 over fingerprint + token ids) for indexing.
"""
from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .errors import BudgetError
from .hashing import PrefixHasher


class Node:
    __slots__ = ("key", "tokens", "kv", "parent", "children", "start", "hits", "pinned", "uid")

    def __init__(self, key, tokens: tuple, kv, parent, start: int, uid: int):
        self.key = key
        self.tokens = tokens
        self.kv = kv                    # [2, layers, kv_heads, n, head_dim] or None for the root
        self.parent = parent
        self.children: dict[int, Node] = {}
        self.start = start              # absolute position of tokens[0]
        self.hits = 0
        self.pinned = False
        self.uid = uid

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def nbytes(self) -> int:
        return 0 if self.kv is None else self.kv.numel() * self.kv.element_size()


@dataclass(slots=True)
class Match:
    """KV spans to reuse for a prompt, in position order: (kv, start, length)."""

    spans: list[tuple[torch.Tensor, int, int]] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(n for _, _, n in self.spans)


@dataclass(slots=True)
class CacheStats:
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    hit_tokens: int = 0
    inserted_tokens: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    dropped_tokens: int = 0         # new tokens not stored because the budget could not hold them


def _common_prefix(node_tokens: tuple, tokens: list[int], offset: int) -> int:
    n = len(node_tokens)
    if tuple(tokens[offset:offset + n]) == node_tokens:
        return n
    limit = min(n, len(tokens) - offset)
    i = 0
    while i < limit and node_tokens[i] == tokens[offset + i]:
        i += 1
    return i


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
        self._lock = threading.Lock()
        self.bytes_used = 0
        self.pinned_bytes = 0
        self.counters = CacheStats()

    # ---- lookup -------------------------------------------------------------------------
    def match(self, tokens: list[int], limit: int | None = None) -> Match:
        """Longest cached prefix of `tokens[:limit]`, token-exact, as KV spans."""
        limit = len(tokens) if limit is None else limit
        wanted = tokens[:limit]
        match = Match()
        with self._lock:
            self.counters.lookups += 1
            node, offset = self.root, 0
            while offset < len(wanted):
                child = node.children.get(wanted[offset])
                if child is None:
                    break
                used = _common_prefix(child.tokens, wanted, offset)
                match.spans.append((child.kv, offset, used))
                self._touch(child)
                offset += used
                if used < len(child.tokens):
                    break
                node = child
            if match.spans:
                self.counters.hits += 1
                self.counters.hit_tokens += offset
            else:
                self.counters.misses += 1
        return match

    def _touch(self, node: Node) -> None:
        node.hits += 1
        self._lru.move_to_end(node.uid)

    # ---- insertion ----------------------------------------------------------------------
    def insert(self, tokens: list[int], chunk_ends: list[int], upto: int,
               kv_slice: Callable[[int, int], torch.Tensor], *, pin: bool = False) -> int:
        """Store KV for `tokens[:upto]`; `kv_slice(start, end)` returns a compact copy.

        New tokens are stored in pieces cut at `chunk_ends`. Returns how many new tokens were
        stored (fewer than asked when the budget cannot hold them and nothing is evictable).
        """
        if self.budget_bytes == 0 or upto <= 0:
            return 0
        tokens = tokens[:upto]
        with self._lock:
            path, offset = self._walk_and_split(tokens)
            pieces = _pieces(offset, upto, chunk_ends)
            need = (upto - offset) * self.bytes_per_token
            if pin:
                self._check_pin_budget(path, need)
            protected = {n.uid for n in path}
            room = self.budget_bytes - self.pinned_bytes - sum(n.nbytes for n in path if not n.pinned)
            self._evict(min(need, max(room, 0)), protected)
            stored = self._attach(path[-1] if path else self.root, tokens, pieces, kv_slice)
            self.counters.inserted_tokens += stored
            self.counters.dropped_tokens += (upto - offset) - stored
            if pin:
                self._pin_path(tokens, offset + stored)
            return stored

    def _walk_and_split(self, tokens: list[int]) -> tuple[list[Node], int]:
        """Follow fully matching nodes; split a partly matching one. Returns (path, matched)."""
        path: list[Node] = []
        node, offset = self.root, 0
        while offset < len(tokens):
            child = node.children.get(tokens[offset])
            if child is None:
                break
            used = _common_prefix(child.tokens, tokens, offset)
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
                    node.start, next(self._uids))
        node.parent.children[head.tokens[0]] = head
        node.tokens = node.tokens[at:]
        node.kv = node.kv[:, :, :, at:].clone()
        node.start += at
        node.parent = head
        head.children[node.tokens[0]] = node
        head.pinned = node.pinned
        head.hits = node.hits
        self._by_key[head.key] = head
        self._lru[head.uid] = head
        self._lru.move_to_end(head.uid, last=False)
        return head

    def _prefix_tokens(self, node: Node) -> list[int]:
        chain = []
        while node is not None and node is not self.root:
            chain.append(node.tokens)
            node = node.parent
        return [t for part in reversed(chain) for t in part]

    def _attach(self, parent: Node, tokens, pieces, kv_slice) -> int:
        hasher = PrefixHasher(self.fingerprint)
        hasher.update(tokens[:pieces[0][0]] if pieces else [])
        stored = 0
        for start, end in pieces:
            kv = kv_slice(start, end)
            nbytes = kv.numel() * kv.element_size()
            if self.bytes_used + nbytes > self.budget_bytes:
                break
            hasher.update(tokens[start:end])
            node = Node(hasher.key(), tuple(tokens[start:end]), kv, parent, start, next(self._uids))
            parent.children[node.tokens[0]] = node
            self._by_key[node.key] = node
            self._lru[node.uid] = node
            self.bytes_used += nbytes
            stored += end - start
            parent = node
        return stored

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

    def _pin_path(self, tokens: list[int], upto: int) -> None:
        node, offset = self.root, 0
        while offset < upto:
            node = node.children.get(tokens[offset])
            if node is None or node.end > upto:
                return
            if not node.pinned:
                node.pinned = True
                self.pinned_bytes += node.nbytes
            offset = node.end

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
                "inserted_tokens": c.inserted_tokens, "dropped_tokens": c.dropped_tokens,
                "evictions": c.evictions, "evicted_bytes": c.evicted_bytes,
                "bytes_used": self.bytes_used, "budget_bytes": self.budget_bytes,
                "pinned_bytes": self.pinned_bytes, "nodes": len(self._lru),
            }

    def check_invariants(self) -> None:
        """Assert the tree's own invariants (used by tests)."""
        with self._lock:
            total = 0
            for node in self._lru.values():
                assert node.parent.children[node.tokens[0]] is node
                assert node.start == node.parent.end
                assert node.kv.shape[3] == len(node.tokens)
                total += node.nbytes
            assert total == self.bytes_used <= self.budget_bytes


def _pieces(start: int, end: int, chunk_ends: list[int]) -> list[tuple[int, int]]:
    """Cut [start, end) at the chunk boundaries that fall inside it."""
    cuts = [c for c in chunk_ends if start < c < end] + [end]
    pieces, cursor = [], start
    for cut in cuts:
        if cut > cursor:
            pieces.append((cursor, cut))
            cursor = cut
    return pieces
