"""Radix-tree nodes and walks over them (no locking, no budget: see cache.py).

A node holds the KV of a run of tokens, valid after exactly the tokens on its root path.
`exact` says whether that KV equals what a full prefill of the path would give; it is False
for KV that came from, or was computed after, a moved (repaired) hit.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


class Node:
    __slots__ = ("key", "tokens", "kv", "parent", "children", "start", "hits", "pinned", "uid",
                 "exact", "content_refs")

    def __init__(self, key, tokens: tuple, kv, parent, start: int, uid: int, exact: bool = True):
        self.key = key                  # prefix key of the whole root path up to this node's end
        self.tokens = tokens
        self.kv = kv                    # [2, layers, kv_heads, n, head_dim]; None for the root
        self.parent = parent
        self.children: dict[int, Node] = {}
        self.start = start              # absolute position of tokens[0]
        self.hits = 0
        self.pinned = False
        self.uid = uid
        self.exact = exact
        self.content_refs: list[tuple[bytes, int]] = []   # content keys whose chunk starts here

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def nbytes(self) -> int:
        return 0 if self.kv is None else self.kv.numel() * self.kv.element_size()


@dataclass(slots=True)
class KVSpan:
    """Cached KV for prompt positions [start, start + length), taken from source positions
    [source_start, ...). `pieces` are (node kv, offset in node, count) in order."""

    start: int
    length: int
    source_start: int
    exact: bool
    pieces: list[tuple[torch.Tensor, int, int]] = field(default_factory=list)


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

    Returns (matched count, pieces [(kv, node offset, count)], all nodes exact).
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
        pieces.append((node.kv, offset, used))
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
