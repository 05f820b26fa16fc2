"""Which entries the disk tier holds, their sizes and recency, under a byte budget; its counters (no I/O)."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


class LruBudget:
    """Entry sizes, least recently used first; `bytes_used` never exceeds `budget_bytes`
    through `reserve` (plain `add` may overshoot, `trim` brings it back). Not locked: the
    owner holds its own lock."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.bytes_used = 0
        self._sizes: OrderedDict[bytes, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sizes)

    def __contains__(self, key: bytes) -> bool:
        return key in self._sizes

    def add(self, key: bytes, size: int) -> None:
        """Record `key` (replacing its old size) as the most recently used entry."""
        self.bytes_used += size - self._sizes.pop(key, 0)
        self._sizes[key] = size

    def size(self, key: bytes) -> int | None:
        return self._sizes.get(key)

    def touch(self, key: bytes) -> None:
        if key in self._sizes:
            self._sizes.move_to_end(key)

    def remove(self, key: bytes) -> int | None:
        """Forget `key`; returns its size, or None if it was not held."""
        size = self._sizes.pop(key, None)
        if size is not None:
            self.bytes_used -= size
        return size

    def reserve(self, key: bytes, size: int, protected: set[bytes]) -> list[bytes] | None:
        """Make room for `key` of `size` bytes by dropping least recently used entries (never
        `key` itself or `protected` ones), then record it. Returns the dropped keys, or None
        (and changes nothing) when it cannot fit."""
        if size > self.budget_bytes:
            return None
        excess = self.bytes_used - self._sizes.get(key, 0) + size - self.budget_bytes
        victims = self._oldest(excess, protected | {key})
        if victims is None:
            return None
        for victim in victims:
            self.remove(victim)
        self.add(key, size)
        return victims

    def trim(self, protected: set[bytes]) -> list[bytes]:
        """Drop least recently used unprotected entries until the budget holds; returns them."""
        victims = []
        for key in list(self._sizes):
            if self.bytes_used <= self.budget_bytes:
                break
            if key not in protected:
                self.remove(key)
                victims.append(key)
        return victims

    def drop_oldest(self, nbytes: int, protected: set[bytes], count: int = 0) -> list[bytes]:
        """Drop the least recently used unprotected entries, at least `nbytes` in all and at least
        `count` of them, and return them; none when the unprotected ones do not reach that."""
        victims = self._oldest(nbytes, protected, count) or []
        for victim in victims:
            self.remove(victim)
        return victims

    def _oldest(self, excess: int, protected: set[bytes], count: int = 0) -> list[bytes] | None:
        """The oldest unprotected keys whose sizes sum to at least `excess`, at least `count` keys;
        None if too few."""
        victims: list[bytes] = []
        for key, size in self._sizes.items():
            if excess <= 0 and len(victims) >= count:
                break
            if key not in protected:
                victims.append(key)
                excess -= size
        return victims if excess <= 0 and len(victims) >= count else None


@dataclass(slots=True)
class DiskStats:
    hits: int = 0
    queued_hits: int = 0            # hits served from the write-behind queue (not yet on disk)
    misses: int = 0
    writes: int = 0
    refused: int = 0                # puts larger than the budget, or with no room left
    dropped_writes: int = 0         # put_async calls refused because the queue was full
    write_errors: int = 0
    no_room: int = 0                # writes the file system refused for room (older entries then evicted)
    read_errors: int = 0            # I/O errors other than a missing file (file kept)
    evictions: int = 0
    corrupt_files_deleted: int = 0   # bad files, and names that are not regular files (FIFOs, links)
    stale_temps_removed: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
