"""Write-behind: one background thread writes queued entries so callers never wait for disk."""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable

log = logging.getLogger(__name__)


class WriteBehind:
    """A queue of (key -> args) written in order by `write(key, *args)` on one daemon thread.

    The queue is bounded by bytes (queued plus the one being written), so spilled KV waiting
    for the disk has a hard memory budget; `submit` refuses rather than blocks when it is full.
    The thread starts on a submit and ends once nothing was queued for IDLE_EXIT_S (the next submit
    starts another): a thread waiting for good would keep the tier, and so its engine's files, alive
    after the engine was dropped without close(). Where no thread can start, the write happens on the
    caller's thread.
    """

    IDLE_EXIT_S = 1.0

    def __init__(self, write: Callable[..., object], max_pending_bytes: int):
        self._write = write
        self.max_pending_bytes = max_pending_bytes
        self.pending_bytes = 0
        self._queue: OrderedDict[bytes, tuple[tuple, int]] = OrderedDict()
        self._busy: tuple[bytes, tuple, int] | None = None        # the entry being written now
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, key: bytes, args: tuple, nbytes: int, supersedes=None) -> bool:
        """Queue a write; False when closed or the byte bound is reached. A key already queued
        or being written is not queued twice (True), unless `supersedes(its args)` says these
        args replace it (they take its place in the queue, or follow the write in progress)."""
        inline = False
        with self._cond:
            if self._closed:
                return False
            on_its_way = self._queue[key][0] if key in self._queue else \
                self._busy[1] if self._busy is not None and self._busy[0] == key else None
            if on_its_way is not None and (supersedes is None or not supersedes(on_its_way)):
                return True
            replaced = self._queue[key][1] if key in self._queue else 0
            if self.pending_bytes - replaced + nbytes > self.max_pending_bytes:
                return False
            self._queue.pop(key, None)
            self._queue[key] = (args, nbytes)
            self.pending_bytes += nbytes - replaced
            if self._thread is None:
                thread = threading.Thread(target=self._run, name="kvboost-disk-writer", daemon=True)
                try:
                    thread.start()
                    self._thread = thread
                except BaseException as err:    # no thread (a process limit; Python 3.12 at interpreter exit,
                    del self._queue[key]        # when the schedulers' last steps store): nothing queued for none,
                    self.pending_bytes -= nbytes    # written here on the caller's thread
                    if not isinstance(err, RuntimeError):
                        raise
                    inline = True
            self._cond.notify_all()
            if not inline:
                return True
        try:
            self._write(key, *args)
        except Exception:
            log.exception("kvboost disk tier: write failed")
        return True

    def lookup(self, key: bytes) -> tuple | None:
        """The args of `key` if it is queued or being written, else None."""
        with self._cond:
            if self._busy is not None and self._busy[0] == key:
                return self._busy[1]
            queued = self._queue.get(key)
            return None if queued is None else queued[0]

    def cancel(self, key: bytes) -> bool:
        """Drop `key` from the queue if it has not started; True if it was dropped."""
        with self._cond:
            queued = self._queue.pop(key, None)
            if queued is None:
                return False
            self.pending_bytes -= queued[1]
            self._cond.notify_all()
            return True

    def __len__(self) -> int:
        with self._cond:
            return len(self._queue) + (self._busy is not None)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued so far is written; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and self._busy is None, timeout)

    def close(self, timeout: float | None = None) -> None:
        """Write what is queued, then stop the thread."""
        self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed, self.IDLE_EXIT_S)
                if not self._queue:             # closed, or idle: a later submit starts a new thread
                    if self._thread is threading.current_thread():
                        self._thread = None
                    return
                key, (args, nbytes) = self._queue.popitem(last=False)
                self._busy = (key, args, nbytes)
            try:
                self._write(key, *args)
            except Exception:               # a failed write is a lost cache entry, never a dead thread
                log.exception("kvboost disk tier: background write failed")
            finally:
                with self._cond:
                    self._busy = None
                    self.pending_bytes -= nbytes
                    self._cond.notify_all()
