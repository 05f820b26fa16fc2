"""Where each chunk of content starts in the radix tree, found by a hash of its tokens.

Moved reuse looks chunks of a new prompt up here, then grows each hit left and right token by
token along the source path, so a document placed at another position or in another order is
found whole, seams included. The cache keeps the index in step with splits and evictions.
"""
from __future__ import annotations

import xxhash

from .keys import token_bytes
from .tree import KVSpan, Node, locate, walk_back, walk_forward

# Chunks of every kind of content are indexed (documents inside one system or user string of
# an unmodified chain included); template glue and generated tokens are not.
NOT_CONTENT = frozenset({"glue", "generated"})


class ContentIndex:
    def __init__(self, fingerprint: bytes):
        self.fingerprint = fingerprint
        self._where: dict[bytes, tuple[Node, int]] = {}     # key -> (node, offset) of the chunk's first token
        self._ends: dict[bytes, tuple[Node, int]] = {}      # key -> (node, offset) of its last token

    def __len__(self) -> int:
        return len(self._where)

    def key(self, token_ids) -> bytes:
        return xxhash.xxh3_128_digest(self.fingerprint + b"content" + token_bytes(token_ids))

    # ---- lookup -------------------------------------------------------------------------
    def spans(self, tokens: list[int], chunk_ends: list[int], chunk_kinds: list[str], start: int,
              limit: int) -> list[KVSpan]:
        """Cached spans for the content chunks of tokens[start:limit], left to right, not overlapping."""
        spans: list[KVSpan] = []
        floor, chunk_start = start, 0
        for end, kind in zip(chunk_ends, chunk_kinds):
            begin, chunk_start = chunk_start, end
            if kind in NOT_CONTENT or end <= floor or end > limit:
                continue
            span = self._grow(tokens, begin, end, floor, limit)
            if span is not None:
                spans.append(span)
                floor = span.start + span.length
        return spans

    def _grow(self, tokens, begin: int, end: int, floor: int, limit: int) -> KVSpan | None:
        found = self._where.get(self.key(tokens[begin:end]))
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
        return KVSpan(first, length, node.start + offset, exact, pieces)

    # ---- maintenance --------------------------------------------------------------------
    def register(self, tokens, chunk_ends, chunk_kinds, path: list[Node]) -> None:
        """Index the content chunks of a stored prompt (`path`: its nodes, root down).
        An existing entry is kept unless the new location is exact and the old one is not.
        The entry is listed on the node where the chunk starts and on the node holding its last
        token, so it goes when either of them is evicted or split away."""
        begin = 0
        for end, kind in zip(chunk_ends, chunk_kinds):
            chunk_begin, begin = begin, end
            if kind in NOT_CONTENT or end > (path[-1].end if path else 0):
                continue
            where, last = locate(path, chunk_begin), locate(path, end - 1)
            key = self.key(tokens[chunk_begin:end])
            known = self._where.get(key)
            if where is None or (known is not None and known[0].alive and (known[0].exact or not where[0].exact)):
                continue
            if known is not None:
                self._forget(key)
            self._where[key], self._ends[key] = where, last
            where[0].content_refs.append((key, where[1]))
            last[0].content_ends.append((key, last[1]))

    def split(self, tail: Node, head: Node, at: int) -> None:
        """`tail` lost its first `at` tokens to `head`: move the entries that start or end there."""
        refs, tail.content_refs = tail.content_refs, []
        for key, off in refs:
            target, target_off = (head, off) if off < at else (tail, off - at)
            target.content_refs.append((key, target_off))
            if self._where.get(key, (None,))[0] is tail:
                self._where[key] = (target, target_off)
        ends, tail.content_ends = tail.content_ends, []
        for key, off in ends:
            target, target_off = (head, off) if off < at else (tail, off - at)
            target.content_ends.append((key, target_off))
            if self._ends.get(key, (None,))[0] is tail:
                self._ends[key] = (target, target_off)

    def remove(self, node: Node) -> None:
        """`node` leaves the tree: drop every entry whose chunk starts or ends in it."""
        for key, _ in node.content_refs:
            if self._where.get(key, (None,))[0] is node:
                self._forget(key)
        for key, _ in node.content_ends:
            if self._ends.get(key, (None,))[0] is node:
                self._forget(key)

    def _forget(self, key: bytes) -> None:
        for table, attribute in ((self._where, "content_refs"), (self._ends, "content_ends")):
            node, offset = table.pop(key)
            listed = getattr(node, attribute)
            if (key, offset) in listed:
                listed.remove((key, offset))

    def check(self) -> None:
        assert self._where.keys() == self._ends.keys()
        for key, (node, offset) in self._where.items():
            assert node.alive and (key, offset) in node.content_refs
            end_node, end_offset = self._ends[key]
            assert end_node.alive and (key, end_offset) in end_node.content_ends
