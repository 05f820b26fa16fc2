"""The radix tree of cached chunks: nodes, their pool blocks, recency; walks, splits, links, removals.

No locking and no budget policy here (cache.py locks, budget.py decides what goes). Every block a
node lists is held by one CACHED pool reference per listing node, taken in `hold` and given back
in `drop`; the pool's CACHED counts are exactly the sum over nodes (`check`).
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from .keys import PrefixHasher
from .pool import CACHED, BlockPool
from .tree import KVSpan, Node, blocks_for, common_prefix


@dataclass(slots=True)
class Match:
    """The longest cached prefix: spans by exactness, and its block table (retained for the caller)."""

    spans: list[KVSpan] = field(default_factory=list)
    table: list[int] = field(default_factory=list)
    counted: int = 0            # the tokens the lookup counted as hit (ChunkCache.give_back takes them back)

    @property
    def length(self) -> int:
        return sum(span.length for span in self.spans)


class RadixTree:
    def __init__(self, fingerprint: bytes, pool: BlockPool, index):
        self.fingerprint = fingerprint
        self.pool = pool
        self.index = index                  # kept in step on split and removal
        self.block_tokens = pool.block_tokens
        self._uids = itertools.count()
        self.root = Node(PrefixHasher(fingerprint).key(), (), [], 0, None, 0, next(self._uids))
        self.nodes: OrderedDict[int, Node] = OrderedDict()     # uid -> node, least recently used first

    def __len__(self) -> int:
        return len(self.nodes)

    # ---- reading ------------------------------------------------------------------------
    def touch(self, node: Node) -> None:
        node.hits += 1
        self.nodes.move_to_end(node.uid)

    def walk(self, tokens, limit: int, touch: bool = True) -> tuple[Match, Node, int]:
        """Follow the tree along tokens[:limit] (token-exact, into a node's middle)."""
        match, node, offset = Match(), self.root, 0
        while offset < limit:
            child = node.children.get(tokens[offset])
            if child is None:
                break
            used = common_prefix(child.tokens[:limit - offset], tokens, offset)
            if touch:
                self.touch(child)
            if not match.spans or match.spans[-1].exact != child.exact:
                match.spans.append(KVSpan(offset, 0, offset, child.exact))
            match.spans[-1].pieces.append((child, 0, used))
            match.spans[-1].length += used
            offset += used
            node = child
            if used < len(child.tokens):
                break
        return match, node, offset

    def path_table(self, nodes: list[Node], first: int, end: int) -> list:
        """Blocks of positions [first, end) along consecutive path nodes (later nodes win a shared block)."""
        table: list = [None] * len(blocks_for(0, end, self.block_tokens))
        for node in nodes:
            for index, block in zip(range(node.first_block, node.first_block + len(node.blocks)), node.blocks):
                if first // self.block_tokens <= index < len(table):
                    table[index] = block
        return table

    def table_of(self, spans: list[KVSpan], first: int, end: int) -> list:
        """Block table for source positions [first, end) of the span pieces, one IN_USE reference per entry."""
        table = self.path_table([node for span in spans for node, _, _ in span.pieces], first, end)
        self.pool.retain([b for b in table if b is not None])
        return table

    def path_nodes(self, node: Node) -> list[Node]:
        """Nodes from the root (excluded) down to `node`."""
        chain = []
        while node is not None and node is not self.root:
            chain.append(node)
            node = node.parent
        return chain[::-1]

    def prefix_tokens(self, node: Node) -> list[int]:
        return [t for n in self.path_nodes(node) for t in n.tokens]

    def leaves(self) -> Iterator[Node]:
        """Unpinned leaves, least recently used first."""
        return (n for n in self.nodes.values() if not n.children and not n.pinned)

    # ---- changing -----------------------------------------------------------------------
    def walk_and_split(self, tokens: list[int]) -> tuple[list[Node], int]:
        """Follow fully matching nodes; split a partly matching one. Returns (path, matched)."""
        path: list[Node] = []
        node, offset = self.root, 0
        while offset < len(tokens):
            child = node.children.get(tokens[offset])
            if child is None:
                break
            used = common_prefix(child.tokens, tokens, offset)
            if used < len(child.tokens):
                child = self.split(child, used)
            self.touch(child)
            path.append(child)
            offset += used
            node = child
        return path, offset

    def split(self, node: Node, at: int) -> Node:
        """Cut `node` after `at` tokens; returns the new head (which keeps the parent link)."""
        hasher = PrefixHasher(self.fingerprint)
        hasher.update(self.prefix_tokens(node.parent) + list(node.tokens[:at]))
        cut = node.start + at
        head_blocks = node.blocks[:len(blocks_for(node.start, cut, self.block_tokens))]
        self.hold(head_blocks)
        head = Node(hasher.key(), node.tokens[:at], head_blocks, node.first_block, node.parent, node.start,
                    next(self._uids), node.exact)
        node.parent.children[head.tokens[0]] = head
        tail_first = cut // self.block_tokens
        self.drop(node.blocks[:tail_first - node.first_block])
        node.blocks = node.blocks[tail_first - node.first_block:]
        node.first_block = tail_first
        node.tokens = node.tokens[at:]
        node.start = cut
        node.parent = head
        head.children[node.tokens[0]] = node
        head.pinned, head.hits = node.pinned, node.hits
        self.index.split(node, head, at)
        self.nodes[head.uid] = head
        return head

    def add(self, parent: Node, key: bytes, tokens: tuple, blocks: list[int], first_block: int, exact: bool) -> Node:
        """A new child of `parent` holding `blocks` (a CACHED reference is taken on each)."""
        self.hold(blocks)
        node = Node(key, tokens, blocks, first_block, parent, parent.end, next(self._uids), exact and parent.exact)
        parent.children[tokens[0]] = node
        self.nodes[node.uid] = node
        return node

    def link(self, parent: Node, tokens, pieces, blocks, first_index: int, exact_upto: int) -> list[Node]:
        """A chain of new nodes under `parent`, one per piece (start, end), over `blocks` (block
        indices first_index..)."""
        hasher = PrefixHasher(self.fingerprint)
        hasher.update(tokens[:pieces[0][0]])
        created = []
        for start, end in pieces:
            indices = blocks_for(start, end, self.block_tokens)
            hasher.update(tokens[start:end])
            parent = self.add(parent, hasher.key(), tuple(tokens[start:end]),
                              blocks[indices.start - first_index:indices.stop - first_index], indices.start,
                              end <= exact_upto)
            created.append(parent)
        return created

    def repoint(self, nodes: list[Node], index: int, old: int, new: int, upto: int) -> None:
        """Nodes ending by `upto` that list `old` as block `index` list `new` instead: a copy holding the
        same KV for their positions (a request's copy-on-write of a shared block), so the old block
        is not kept alive for positions the copy already holds."""
        for node in nodes:
            i = index - node.first_block
            if node.end <= upto and 0 <= i < len(node.blocks) and node.blocks[i] == old:
                self.hold([new])
                node.blocks[i] = new
                self.drop([old])

    def remove(self, node: Node) -> int:
        """Take a leaf out of the tree; returns the bytes of blocks it listed."""
        assert not node.children, "only leaves are removed"
        del node.parent.children[node.tokens[0]]
        del self.nodes[node.uid]
        self.index.remove(node)
        listed = len(node.blocks) * self.pool.block_bytes
        self.drop(node.blocks)
        node.blocks = []
        node.alive = False
        return listed

    def hold(self, blocks: list[int]) -> None:
        self.pool.retain(blocks, CACHED)

    def drop(self, blocks: list[int]) -> None:
        self.pool.release(blocks, CACHED)

    # ---- invariants ---------------------------------------------------------------------
    def check(self) -> None:
        """Assert the tree's invariants (used by tests)."""
        refs = np.zeros(self.pool.total_blocks, dtype=np.int64)
        for node in self.nodes.values():
            assert node.alive and node.parent.children[node.tokens[0]] is node
            assert node.start == node.parent.end
            assert range(node.first_block, node.first_block + len(node.blocks)) == \
                blocks_for(node.start, node.end, self.block_tokens)
            assert node.exact or not any(c.exact for c in node.children.values())
            np.add.at(refs, np.asarray(node.blocks, dtype=np.int64), 1)
        assert (refs == self.pool.cached_refs()).all(), "CACHED references differ from the nodes' blocks"
