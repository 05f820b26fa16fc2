"""Document sequences sent after each prompt prefix, to order new requests' documents like them."""
from __future__ import annotations

import threading

import xxhash


class DocumentSequences:
    """Document sequences sent after each prefix: a trie keyed by (prefix hash, document hashes).

    `order` puts the documents that continue the longest remembered sequence first, in that
    sequence's order (the most recent on ties), then the others as given. Least recently used
    branches are forgotten past `capacity` nodes.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._root: dict = {}
        self._nodes = 0
        self._clock = 0
        self._lock = threading.Lock()

    def order(self, prefix: int, texts: list[str], record: bool = True) -> tuple[list[str], int]:
        """`texts` in their send order after the prefix hashed as `prefix`, and how many of them
        continue a remembered sequence (they go first). `record`: remember this sequence."""
        hashes = [xxhash.xxh64_intdigest(text.encode()) for text in texts]
        if len(set(hashes)) < len(hashes):      # a document twice: leave the run as it is
            return list(texts), 0
        by_hash = dict(zip(hashes, texts))
        with self._lock:
            node = self._root.get(prefix)
            path = _longest_path(node, set(hashes)) if node else []
            sequence = path + [h for h in hashes if h not in set(path)]
            if record:
                self._record(prefix, sequence)
        return [by_hash[h] for h in sequence], len(path)

    def _record(self, prefix: int, sequence: list[int]) -> None:
        self._clock += 1
        level = self._root
        for key in [prefix, *sequence]:
            if key not in level:
                level[key] = [{}, self._clock]
                self._nodes += 1
            level[key][1] = self._clock
            level = level[key][0]
        while self._nodes > self.capacity:
            self._forget_oldest_leaf()

    def _forget_oldest_leaf(self) -> None:
        oldest, parent, key = None, None, None
        stack = [self._root]
        while stack:
            level = stack.pop()
            for child_key, (children, stamp) in level.items():
                if not children and (oldest is None or stamp < oldest):
                    oldest, parent, key = stamp, level, child_key
                stack.append(children)
        assert parent is not None
        del parent[key]
        self._nodes -= 1


def _longest_path(node, wanted: set[int]) -> list[int]:
    """The longest chain of `wanted` documents below `node`; the most recent branch on ties."""
    best: list[int] = []
    best_stamp = -1
    for key, (children, stamp) in node[0].items():
        if key not in wanted:
            continue
        path = [key] + _longest_path((children, stamp), wanted - {key})
        if len(path) > len(best) or (len(path) == len(best) and stamp > best_stamp):
            best, best_stamp = path, stamp
    return best
