"""Radix-tree nodes and walks over them (no locking, no budget: see cache.py).

A node stands for a run of tokens whose KV, valid after exactly the tokens on its root path,
lives in pool blocks: `blocks[i]` holds block index `first_block + i` (positions
[(first_block + i) * B, ...)). A block that a node starts or ends inside also holds the KV of
the neighbouring positions of the same path, so a path's block table is read node by node.
`exact` says whether that KV equals what a full prefill of the path would give; it is False
for KV that came from, or was computed after, a moved (repaired) hit.
"""
from __future__ import annotations

from dataclasses import dataclass, field


class Node:
    __slots__ = ("key", "tokens", "blocks", "first_block", "parent", "children", "start", "hits", "pinned",
                 "uid", "exact", "content_refs", "content_ends", "alive")

    def __init__(self, key, tokens: tuple, blocks: list[int], first_block: int, parent, start: int, uid: int,
                 exact: bool = True):
        self.key = key                  # prefix key of the whole root path up to this node's end
        self.tokens = tokens
        self.blocks = blocks            # pool blocks (one reference held per entry)
        self.first_block = first_block
        self.alive = True
        self.parent = parent
        self.children: dict[int, Node] = {}
        self.start = start              # absolute position of tokens[0]
        self.hits = 0
        self.pinned = False
        self.uid = uid
        self.exact = exact
        self.content_refs: list = []    # content-index places (content_index.Place) that start here
        self.content_ends: list = []    # ... and those whose last token is here

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


def blocks_for(start: int, end: int, block_tokens: int) -> range:
    """Block indices touched by positions [start, end)."""
    return range(start // block_tokens, (end - 1) // block_tokens + 1) if end > start else range(0)


@dataclass(slots=True)
class KVSpan:
    """Cached KV for prompt positions [start, start + length), taken from source positions
    [source_start, ...). `pieces` are (node, offset in node, count) in order; `table` maps block
    indices to blocks (None where not covered) and holds one pool reference per entry, which
    the caller gives back once it has read or mapped the KV."""

    start: int
    length: int
    source_start: int
    exact: bool
    pieces: list[tuple["Node", int, int]] = field(default_factory=list)
    table: list = field(default_factory=list)


def common_prefix(node_tokens: tuple, tokens: list[int], offset: int) -> int:
    """How many of `node_tokens` equal `tokens[offset:]` from the start."""
    n = len(node_tokens)
    if tuple(tokens[offset:offset + n]) == node_tokens:
        return n
    limit = min(n, len(tokens) - offset)
    i = 0
    while i < limit and node_tokens[i] == tokens[offset + i]:
        i += 1
    return i


def walk_forward(node: Node, offset: int, tokens: list[int], start: int, stop: int) -> tuple[int, list, bool]:
    """Follow the tree from (node, offset) while it agrees with tokens[start:stop].

    Returns (matched count, pieces [(node, node offset, count)], all nodes exact).
    """
    matched, pieces, exact = 0, [], True
    while start + matched < stop:
        if offset == len(node.tokens):
            node = node.children.get(tokens[start + matched])
            if node is None:
                break
            offset = 0
        avail = node.tokens[offset:offset + stop - start - matched]
        used = common_prefix(avail, tokens, start + matched)
        if used == 0:
            break
        pieces.append((node, offset, used))
        exact = exact and node.exact
        matched += used
        offset += used
        if offset < len(node.tokens):
            break
    return matched, pieces, exact


def walk_back(node: Node, offset: int, tokens: list[int], position: int, floor: int) -> tuple[Node, int, int]:
    """Step back from (node, offset) while the preceding source token equals tokens[position - 1],
    not below `floor`. Returns the new (node, offset) and how many tokens were added."""
    added = 0
    while position - added > floor:
        if offset == 0:
            if node.parent is None or node.parent.parent is None:
                break
            node, offset = node.parent, len(node.parent.tokens)
        if node.tokens[offset - 1] != tokens[position - added - 1]:
            break
        offset -= 1
        added += 1
    return node, offset, added


def locate(path: list[Node], position: int) -> tuple[Node, int] | None:
    """The node on `path` (ordered root-down) holding absolute `position`, and the offset in it."""
    for node in path:
        if node.start <= position < node.end:
            return node, position - node.start
    return None
