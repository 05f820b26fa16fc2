"""Running systems over workloads: the timing loop, and the peak-memory probe of one system.

Timing: every system answers the first request of every workload once first (warm-up, not
recorded); then, `repeats` times, every sequence is answered by every system from an empty
cache, systems interleaved (their order rotates each repeat) so machine noise hits them alike.
"""
from __future__ import annotations

import os
import sys
import time

from .systems import System
from .workloads import Workload


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run_timing(systems: list[System], workloads: list[Workload], repeats: int) -> dict:
    """{system id: {workload: {sequence key: [repeat][request] -> measurements}}}."""
    raw = {s.id: {w.name: {q.key: [] for q in w.sequences} for w in workloads} for s in systems}
    for workload in workloads:
        for system in systems:
            begun = time.perf_counter()
            system.reset()
            system.answer(workload.sequences[0].requests[0], workload.max_new_tokens)
            log(f"warm-up {workload.name} {system.id}: {time.perf_counter() - begun:.1f}s")
    log(f"warm-up done ({', '.join(s.id for s in systems)})")
    for repeat in range(repeats):
        order = systems[repeat % len(systems):] + systems[:repeat % len(systems)]
        for workload in workloads:
            for sequence in workload.sequences:
                started = time.perf_counter()
                spent = []
                for system in order:
                    begun = time.perf_counter()
                    system.reset()
                    answers = [system.answer(request, workload.max_new_tokens) for request in sequence.requests]
                    raw[system.id][workload.name][sequence.key].append(answers)
                    spent.append(f"{system.id} {time.perf_counter() - begun:.1f}s")
                log(f"repeat {repeat + 1}/{repeats} {workload.name} {sequence.key}: "
                    f"{time.perf_counter() - started:.0f}s ({', '.join(spent)})")
    return raw


# ---- peak memory -----------------------------------------------------------------------------
def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) of this process; False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    kib = _status_kib("VmHWM")
    if kib is None:
        import resource
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib * 1024


def rss_bytes() -> int:
    kib = _status_kib("VmRSS")
    return (kib or 0) * 1024


def probe_memory(system: System, workloads: list[Workload]) -> dict:
    """Peak RSS while `system` answers every sequence once (model weights included; the
    transient peak of loading the model is excluded by resetting the mark after the load)."""
    load_peak = peak_rss_bytes()
    resettable = reset_peak_rss()
    loaded = rss_bytes()
    for workload in workloads:
        for sequence in workload.sequences:
            system.reset()
            for request in sequence.requests:
                system.answer(request, workload.max_new_tokens)
    return {"peak_rss_bytes": peak_rss_bytes(), "rss_after_load_bytes": loaded, "load_peak_rss_bytes": load_peak,
            "peak_excludes_load": resettable, "pid": os.getpid()}
