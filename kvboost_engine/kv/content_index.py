"""Where content sits in the radix tree, found by a hash of its tokens (moved reuse).

Content is indexed by anchors (anchors.py): short runs of tokens at content-defined points, the
same wherever the text is placed. Moved reuse looks the anchors of a new prompt up here, then
grows each hit left and right token by token along the source path, so a document placed at
another position or in another order, as a part or joined into one string, is found whole,
seams included. A phrase that recurs in several documents has an anchor in each: the index keeps
a few places per anchor and a lookup takes the one that grows longest. The cache keeps the
index in step with splits and evictions.
"""
from __future__ import annotations

import xxhash

from .anchors import ANCHOR_TOKENS, anchor_ends, content_regions
from .keys import token_bytes
from .tree import KVSpan, Node, locate, walk_back, walk_forward

# Every kind of content is indexed (documents inside one system or user string of an unmodified
# chain included); template glue and generated tokens are not.
NOT_CONTENT = frozenset({"glue", "generated"})
PLACES_PER_ANCHOR = 4


class Place:
    """One place of an anchor: its first token at (node, offset), its last at (end_node, end_offset)."""

    __slots__ = ("key", "node", "offset", "end_node", "end_offset")

    def __init__(self, key: bytes, start: tuple[Node, int], last: tuple[Node, int]):
        self.key = key
        self.node, self.offset = start
        self.end_node, self.end_offset = last


class ContentIndex:
    def __init__(self, fingerprint: bytes):
        self.fingerprint = fingerprint
        self._places: dict[bytes, list[Place]] = {}         # anchor key -> places, newest first

    def __len__(self) -> int:
        return sum(len(places) for places in self._places.values())

    def key(self, token_ids) -> bytes:
        return xxhash.xxh3_128_digest(self.fingerprint + b"content" + token_bytes(token_ids))

    # ---- lookup -------------------------------------------------------------------------
    def spans(self, tokens: list[int], chunk_ends: list[int], chunk_kinds: list[str], start: int,
              limit: int) -> list[KVSpan]:
        """Cached spans for the content of tokens[start:limit], left to right, not overlapping."""
        spans: list[KVSpan] = []
        floor = start
        for end in anchor_ends(tokens, content_regions(chunk_ends, chunk_kinds, NOT_CONTENT, start, limit)):
            if end <= floor:
                continue
            grown = [self._grow(tokens, place, end - ANCHOR_TOKENS, end, floor, limit)
                     for place in self._places.get(self.key(tokens[end - ANCHOR_TOKENS:end]), ())]
            grown = [span for span in grown if span is not None]
            if grown:
                best = max(grown, key=lambda s: (s.length, s.exact))
                spans.append(best)
                floor = best.start + best.length
        return spans

    @staticmethod
    def _grow(tokens, place: Place, begin: int, end: int, floor: int, limit: int) -> KVSpan | None:
        node, offset = place.node, place.offset
        matched, _, _ = walk_forward(node, offset, tokens, begin, end)
        if matched != end - begin:                      # compare the tokens on every hit
            return None
        if begin < floor:
            # The previous span already covers the anchor's head: continue from where it ended.
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
        """Index the content anchors of a stored prompt (`path`: its nodes, root down).

        Each anchor keeps up to PLACES_PER_ANCHOR places (newest first; a place on exact KV is
        kept before one that is not). A place is listed on the node where it starts and on the
        node holding its last token, so it goes when either of them is evicted."""
        stored = path[-1].end if path else 0
        for end in anchor_ends(tokens, content_regions(chunk_ends, chunk_kinds, NOT_CONTENT, 0, stored)):
            begin = end - ANCHOR_TOKENS
            start, last = locate(path, begin), locate(path, end - 1)
            if start is None or last is None:
                continue
            key = self.key(tokens[begin:end])
            places = self._places.setdefault(key, [])
            if any(p.node is start[0] and p.offset == start[1] for p in places):
                continue
            place = Place(key, start, last)
            places.insert(0, place)
            start[0].content_refs.append(place)
            last[0].content_ends.append(place)
            if len(places) > PLACES_PER_ANCHOR:
                inexact = [p for p in places if not p.node.exact]
                self._drop(inexact[-1] if inexact else places[-1])

    def split(self, tail: Node, head: Node, at: int) -> None:
        """`tail` lost its first `at` tokens to `head`: move the places that start or end there."""
        _move_at_split(tail, head, at, "content_refs", "node", "offset")
        _move_at_split(tail, head, at, "content_ends", "end_node", "end_offset")

    def remove(self, node: Node) -> None:
        """`node` leaves the tree: drop every place that starts or ends in it."""
        for place in node.content_refs + node.content_ends:
            self._drop(place)

    def _drop(self, place: Place) -> None:
        places = self._places.get(place.key, [])
        if place not in places:
            return
        places.remove(place)
        if not places:
            del self._places[place.key]
        for listed in (place.node.content_refs, place.end_node.content_ends):
            if place in listed:
                listed.remove(place)

    def check(self) -> None:
        for key, places in self._places.items():
            assert places and len(places) <= PLACES_PER_ANCHOR
            for place in places:
                assert place.key == key and place.node.alive and place.end_node.alive
                assert place in place.node.content_refs and place in place.end_node.content_ends


def _move_at_split(tail: Node, head: Node, at: int, refs: str, node: str, offset: str) -> None:
    """Places listed in `tail.<refs>` whose `<offset>` falls in the first `at` tokens move to `head`;
    the others stay in `tail`, `at` tokens earlier."""
    places, kept = getattr(tail, refs), []
    for place in places:
        if getattr(place, offset) < at:
            setattr(place, node, head)
            getattr(head, refs).append(place)
        else:
            setattr(place, offset, getattr(place, offset) - at)
            kept.append(place)
    setattr(tail, refs, kept)
