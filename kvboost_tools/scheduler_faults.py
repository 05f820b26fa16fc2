"""Fault injection into the engine's scheduler, for chaos runs (`benchmarks.micro.chaos`): while a
`SchedulerFaults` is entered, each seam the scheduler calls at a step kind raises InjectedFault with
probability `rate` per call (a seeded RNG). It wraps module attributes for the time it is entered:
a tool for testing what callers get when something breaks, never for measuring speed.

    with SchedulerFaults(rate=0.01, seed=0) as faults:
        ...                     # drive requests
    faults.injected             # how many faults each seam raised
"""
from __future__ import annotations

import random
import threading

from kvboost_engine.request import decode, scheduler
from kvboost_engine.request.detok import TextAssembler

SEAMS = {   # name -> (owner, attribute): the functions the scheduler calls at each step kind
    "admission_check": (scheduler, "continues_a_prefill"), "admission_assemble": (scheduler, "assemble"),
    "prefill_settle": (scheduler, "prefilled"), "first_token": (decode.Decoding, "begin"),
    "decode_settle": (decode.Decoding, "advance"), "kv_store": (decode, "store"),
    "text_end": (TextAssembler, "finish"),
}


class InjectedFault(RuntimeError):
    pass


class SchedulerFaults:
    """While entered, each seam raises InjectedFault with probability `rate` per call (seeded)."""

    def __init__(self, rate: float, seed: int):
        self.rate, self.rng, self.lock = rate, random.Random(seed), threading.Lock()
        self.injected = dict.fromkeys(SEAMS, 0)
        self._saved: list = []

    def __enter__(self):
        for name, (owner, attr) in SEAMS.items():
            original = getattr(owner, attr)
            self._saved.append((owner, attr, original))
            setattr(owner, attr, self._wrap(name, original))
        return self

    def __exit__(self, *exc):
        for owner, attr, original in reversed(self._saved):
            setattr(owner, attr, original)

    def _wrap(self, name: str, original):
        def faulty(*args, **kwargs):
            with self.lock:
                hit = self.rng.random() < self.rate
                self.injected[name] += hit
            if hit:
                raise InjectedFault(f"injected at {name}")
            return original(*args, **kwargs)
        return faulty
