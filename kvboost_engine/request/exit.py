"""Scheduler threads at interpreter exit: every scheduler is stopped between two steps (not inside a
forward), then its threads are waited for. An idle one may still be freeing the engine it held last,
and a tensor freed by a daemon thread after finalization aborts the process ("terminate called
without an active exception"). Then the disk tiers' queued writes are flushed: the steps ended
last stored their chunks too.
"""
from __future__ import annotations

import atexit
import threading
import weakref

live_schedulers: weakref.WeakSet = weakref.WeakSet()     # schedulers not yet collected (each has close())
scheduler_threads: weakref.WeakSet = weakref.WeakSet()   # their loop threads not yet ended
flushed_at_exit: weakref.WeakSet = weakref.WeakSet()     # disk tiers of open engines (each has flush())


@atexit.register
def _close_all() -> None:
    for scheduler in list(live_schedulers):
        scheduler.close()
    for thread in [t for t in scheduler_threads if t is not threading.current_thread()]:
        thread.join(timeout=60)
    for tier in list(flushed_at_exit):
        tier.flush(timeout=60)
