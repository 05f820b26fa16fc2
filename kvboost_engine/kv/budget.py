"""What the chunk cache may keep: its byte budget, pins, and which chunks go when room is needed.

Two limits meet here. The cache's own budget (`cache_bytes`) caps the blocks cached chunks hold;
past it, least recently used leaves go, then new chunks are not stored. The pool is shared with
running requests: `make_room` evicts cached chunks so a request gets its blocks, but only chunks
whose blocks nothing else holds (dropping a chunk a running request maps frees nothing), and
nothing at all when eviction could not free enough (a request refused anyway leaves the cache
as it was). A leaf that shares its only block with its parent frees nothing by itself but is
evicted on the way to its parent, so cached chunks never wedge the pool.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import BudgetError
from .radix import RadixTree
from .tree import Node, blocks_for


@dataclass(slots=True)
class EvictionStats:
    evictions: int = 0
    evicted_bytes: int = 0


class CacheBudget:
    def __init__(self, tree: RadixTree, budget_bytes: int):
        self.tree = tree
        self.pool = tree.pool
        self.budget_bytes = budget_bytes
        self.pinned_bytes = 0
        self.stats = EvictionStats()

    @property
    def bytes_used(self) -> int:
        """Bytes of the blocks cached chunks hold (shared with running requests or not)."""
        return self.pool.usage()["cached"] * self.pool.block_bytes

    def fitting(self, pieces: list[tuple[int, int]], path: list[Node]) -> list[tuple[int, int]]:
        """The leading pieces whose blocks fit the budget next to pinned chunks and the path."""
        room = self._room(path)
        b = self.pool.block_tokens
        return [piece for piece in pieces if len(blocks_for(pieces[0][0], piece[1], b)) <= room]

    def fitting_end(self, start: int, path: list[Node]) -> int:
        """The furthest position whose KV from `start` on could be cached next to pinned chunks and the
        path (`start` itself when nothing more fits): how far a disk read is worth going."""
        b = self.pool.block_tokens
        return max(start, (start // b + self._room(path)) * b)

    def _room(self, path: list[Node]) -> int:
        """Blocks the budget has beside pinned chunks and the path's own."""
        kept = {b for n in self.tree.nodes.values() if n.pinned for b in n.blocks} | {b for n in path for b in n.blocks}
        return self.budget_bytes // self.pool.block_bytes - len(kept)

    def enforce(self, protected: set[int], created: list[Node]) -> None:
        """Evict old leaves until the cache holds at most its budget; if that is not enough,
        give up the newest of the nodes just created (never stored, not an eviction)."""
        while self.bytes_used > self.budget_bytes:
            victim = next((n for n in self.tree.leaves() if n.uid not in protected), None)
            if victim is None:
                break
            self.evict(victim)
        for node in reversed(created):
            if self.bytes_used <= self.budget_bytes:
                break
            if not node.children and not node.pinned:
                self.tree.remove(node)

    def make_room(self, blocks: int, protected: set[int] = frozenset()) -> None:
        """Evict cached chunks until the pool has `blocks` free blocks (for a running sequence): in RAM
        where evicting can free them there (a sequence with a block in the spill file runs every step on
        the PyTorch loop: 11x slower in a review), else anywhere (RAM and spill file)."""
        pool = self.pool
        for free, below in ((pool.free_ram_blocks, pool.ram_blocks), (pool.free_blocks, pool.total_blocks)):
            if free() >= blocks:
                return
            if self._freeable(protected, below) < blocks - free():
                continue
            while free() < blocks:      # oldest leaves first, spill-file ones too (a RAM parent is a leaf after them)
                victim = next((n for n in self.tree.leaves()
                               if n.uid not in protected and self.pool.only_cached(n.blocks).any()), None)
                if victim is None:
                    break
                self.evict(victim)

    def _freeable(self, protected: set[int], below: int) -> int:
        """Blocks with ids below `below` (ram_blocks: in RAM) that evicting unpinned, unprotected chunks
        would free (held by nothing else). Only leaves go, so a kept chunk keeps its ancestors too
        (they never become leaves above it)."""
        keep = [n for n in self.tree.nodes.values() if n.pinned or n.uid in protected]
        kept = {b for n in keep for m in self.tree.path_nodes(n) for b in m.blocks}
        candidates = np.flatnonzero(self.pool.only_cached())
        return len(set(candidates[candidates < below].tolist()) - kept)

    def evict(self, node: Node) -> None:
        self.stats.evictions += 1
        self.stats.evicted_bytes += self.tree.remove(node)

    # ---- pins ---------------------------------------------------------------------------
    def check_pin(self, tokens: int, path: list[Node] = ()) -> None:
        """Raise BudgetError unless a pinned prefix of `tokens` positions fits next to what is pinned."""
        block_bytes = self.pool.block_bytes
        need = self.pinned_bytes + sum(len(n.blocks) * block_bytes for n in path if not n.pinned)
        start = path[-1].end if path else 0
        need += len(blocks_for(start, tokens, self.pool.block_tokens)) * block_bytes
        if need > self.budget_bytes:
            raise BudgetError(f"pinning needs {need} bytes of KV but cache_bytes is {self.budget_bytes} "
                              f"(already pinned: {self.pinned_bytes})")

    def pin(self, nodes: list[Node]) -> None:
        for node in nodes:
            if not node.pinned and node.alive:
                node.pinned = True
                self.pinned_bytes += len(node.blocks) * self.pool.block_bytes
