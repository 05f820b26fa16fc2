"""Which replica answers a request: consistent hashing with bounded loads, and failover order.

`policy="cache"`: a request's route key (the hash of its leading segments, see layout.py) picks
a point on a hash ring of the replicas (64 virtual nodes each); the first replica clockwise
whose in-flight count is under the load bound `ceil(load_factor * (in_flight + 1) / healthy)`
answers it (Mirrokni, Thorup and Zadimoghaddam, "Consistent Hashing with Bounded Loads"). The
same prefix therefore keeps landing where its KV is cached, unless that replica is overloaded
or down. `policy="round_robin"` is the baseline that scatters prefixes.

`candidates` returns every replica, best first: the chosen one, the rest clockwise, replicas
marked down (after a failure, for `cooldown_s`) last, the one whose cooldown ends first first.
The caller tries them in that order; a replica that answers is marked up again.
"""
from __future__ import annotations

import bisect
import itertools
import math
import threading
import time
from collections.abc import Sequence

import xxhash

from kvboost_engine import InputError

POLICIES = ("cache", "round_robin")
VIRTUAL_NODES = 64


class HashRing:
    """Replica names placed at VIRTUAL_NODES points each on a 64-bit ring."""

    def __init__(self, names: Sequence[str], virtual_nodes: int = VIRTUAL_NODES):
        points = sorted((xxhash.xxh64_intdigest(f"{name}#{i}".encode()), name)
                        for name in names for i in range(virtual_nodes))
        self._hashes = [point for point, _ in points]
        self._names = [name for _, name in points]
        self._count = len(set(names))

    def walk(self, key: int) -> list[str]:
        """Every replica once, clockwise from `key`."""
        start = bisect.bisect_left(self._hashes, key % 2**64)
        seen: dict[str, None] = {}
        for offset in range(len(self._names)):
            seen.setdefault(self._names[(start + offset) % len(self._names)])
            if len(seen) == self._count:
                break
        return list(seen)


class Router:
    """Routing state of a set of replicas: in-flight counts, down marks, the ring (thread-safe)."""

    def __init__(self, names: Sequence[str], *, policy: str = "cache", load_factor: float = 1.25,
                 cooldown_s: float = 10.0):
        if not names:
            raise InputError("at least one endpoint is needed")
        if len(set(names)) != len(names):
            raise InputError(f"endpoints must differ, got {list(names)}")
        if policy not in POLICIES:
            raise InputError(f"routing must be one of {POLICIES}, got {policy!r}")
        if load_factor < 1.0:
            raise InputError(f"load_factor must be at least 1.0, got {load_factor}")
        if cooldown_s < 0:
            raise InputError(f"cooldown_s must be >= 0, got {cooldown_s}")
        self.names = list(names)
        self.policy = policy
        self.load_factor = load_factor
        self.cooldown_s = cooldown_s
        self._ring = HashRing(self.names)
        self._in_flight = dict.fromkeys(self.names, 0)
        self._begun = dict.fromkeys(self.names, 0)         # requests ever sent to each (see `load`)
        self._down_until = dict.fromkeys(self.names, 0.0)
        self._turn = itertools.count()
        self._lock = threading.Lock()

    def candidates(self, key: int) -> list[str]:
        """All replicas in the order to try them for a request with route `key`."""
        with self._lock:
            now = time.monotonic()
            order = self._ring.walk(key) if self.policy == "cache" else self._rotation()
            healthy = [name for name in order if self._down_until[name] <= now]
            down = sorted((name for name in order if name not in healthy), key=self._down_until.__getitem__)
            if self.policy == "cache" and healthy:
                bound = math.ceil(self.load_factor * (sum(self._in_flight.values()) + 1) / len(healthy))
                first = next((name for name in healthy if self._in_flight[name] < bound), healthy[0])
                healthy.remove(first)
                healthy.insert(0, first)
            return healthy + down

    def _rotation(self) -> list[str]:
        start = next(self._turn) % len(self.names)
        return self.names[start:] + self.names[:start]

    def begin(self, name: str) -> None:
        """A request is being sent to `name`."""
        with self._lock:
            self._in_flight[name] += 1
            self._begun[name] += 1

    def load(self, name: str) -> tuple[int, int]:
        """(requests in flight at `name`, requests ever sent to it): unchanged across a request that
        was in flight alone, no other sent meanwhile (its server's counters are then its own)."""
        with self._lock:
            return self._in_flight[name], self._begun[name]

    def end(self, name: str) -> None:
        """A request to `name` finished (or failed)."""
        with self._lock:
            assert self._in_flight[name] > 0, name
            self._in_flight[name] -= 1

    def mark_down(self, name: str) -> None:
        """`name` failed: try it last until the cooldown has passed."""
        with self._lock:
            self._down_until[name] = time.monotonic() + self.cooldown_s

    def mark_up(self, name: str) -> None:
        with self._lock:
            self._down_until[name] = 0.0

    def state(self) -> dict:
        """In-flight count and down flag per replica."""
        with self._lock:
            now = time.monotonic()
            return {name: {"in_flight": self._in_flight[name], "down": self._down_until[name] > now}
                    for name in self.names}
