"""Continuous batching: every request of an engine runs on one scheduler thread, in shared forwards.

Each step is one forward over the next token of every decoding request plus, within a token budget
(`max_batch_tokens`), a chunk of the prompts still being prefilled (chunked prefill): the weights are read
once for all of them, each sequence attends over its own block table (shared prefix blocks mapped, not
copied), and a long prompt never holds the others' decoding for more than one chunk. Requests come from any
thread or event loop (`submit`); their results come back through their Channel.

Admission: a request joins when a running slot (`max_running`) is free and its KV can be reserved. One that
waits (a bounded queue, `max_waiting` beyond the free slots) gets a clear QueueFullError (a BudgetError: retry
later) after `queue_timeout_s`; one that cannot fit the pool even alone is refused at once with a BudgetError.
A request whose prompt continues a prompt still being prefilled waits for it to be stored, so concurrent chats
over one system prompt hold its blocks once.

Faults: an exception while handling one request ends that request with it, the others go on; one the loop
cannot pin on a request ends the admitted ones with a clear error. A caller never waits on a dead thread.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future

import torch

from ..errors import BudgetError, InputError, KVBoostError, QueueFullError
from .admission import check_fits_alone, continues_a_prefill
from .decode import Decoding, EngineParts, Request, messages_after
from .endings import cancelled as _cancelled, guarded as _guarded, internal as _internal, \
    refuse as _refuse, run_task as _run_task
from .exit import live_schedulers, scheduler_threads
from .openmp import release_thread_pool
from .plan import Prefilling, plan_step
from .prefill import Assembled, assemble, prefilled, repair

log = logging.getLogger(__name__)

class Scheduler:
    def __init__(self, parts: EngineParts, *, max_running: int, max_batch_tokens: int, max_waiting: int,
                 queue_timeout_s: float):
        if max_batch_tokens < max_running:
            raise KVBoostError(f"max_batch_tokens ({max_batch_tokens}) must be >= max_running ({max_running}): "
                               "else prompts being prefilled get no tokens while the others decode")
        self.parts = parts
        self.max_running, self.max_batch_tokens = max_running, max_batch_tokens
        self.max_waiting, self.queue_timeout_s = max_waiting, queue_timeout_s
        self._waiting: deque[Request] = deque()
        self._prefilling: list[Prefilling] = []
        self._decoding: list[Decoding] = []
        self._repairing = 0                 # a request between the queue and decoding (active counts it)
        self._tasks: deque[tuple] = deque()
        self._cond, self._closed = threading.Condition(), False
        self._thread: threading.Thread | None = None
        live_schedulers.add(self)

    # ---- callers ------------------------------------------------------------------------
    def submit(self, request: Request) -> None:
        """Queue a request; its deltas and result arrive through request.channel. Not from the
        scheduler thread (an observer's callback): its reply would wait on the thread waiting for it."""
        if self.on_thread():
            raise InputError("a request cannot be made from an instrument callback (it runs on the engine's "
                             "scheduler thread, which would wait for itself); next_token_logits and warm can")
        check_fits_alone(self.parts.prefill, request)
        with self._cond:
            if self._closed:
                raise KVBoostError("this engine is closed")
            free_slots = max(0, self.max_running - self.active)
            if len(self._waiting) >= self.max_waiting + free_slots:
                raise QueueFullError(f"{len(self._waiting)} requests are already waiting for a running slot or KV "
                                  f"room (max_waiting={self.max_waiting}, max_running={self.max_running}); "
                                  "try again later")
            self._enqueue(self._waiting, request)
        release_thread_pool()               # the caller now waits: its idle OpenMP workers would slow ours

    def call(self, fn):
        """Run `fn()` on the scheduler thread between two steps and return its result."""
        if self.on_thread():
            return fn()                     # already there (an observer calling back): no self-wait
        future: Future = Future()
        with self._cond:
            if self._closed:
                raise KVBoostError("this engine is closed")
            self._enqueue(self._tasks, (fn, future))
        return future.result()

    def on_thread(self) -> bool:
        """Whether the caller runs on the scheduler thread (an observer's callback)."""
        return threading.current_thread() is self._thread

    def close(self) -> None:
        """Cancel what waits or runs, and stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    @property
    def active(self) -> int:
        """Requests admitted and not finished. A decoding request counts until it finishes, not
        until the loop drops it from its list right after: a caller that has its reply already
        reads 0 (the loop hands the reply over before it drops the request)."""
        return len(self._prefilling) + self._repairing + sum(not d.finished for d in list(self._decoding))

    def _enqueue(self, queue: deque, item) -> None:
        """Queue `item` and wake the loop, starting its thread if none runs (under self._cond). A thread
        that cannot start (a process's thread limit, interpreter shutdown) raises here with the item taken
        back and no thread recorded: the next call tries again, nothing waits on a loop that never ran."""
        queue.append(item)
        if self._thread is None:
            thread = threading.Thread(target=self._loop, name="kvboost-scheduler", daemon=True)
            try:
                thread.start()
            except BaseException:
                queue.remove(item)
                raise
            self._thread = thread
            scheduler_threads.add(thread)
        self._cond.notify()

    # ---- the loop -----------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            with torch.inference_mode():    # grad mode is per thread: KV made inside or outside one works
                self._run()
        except BaseException as err:  # noqa: BLE001 - a fault outside any step: no caller waits on a dead thread
            log.exception("kvboost scheduler loop failed; its requests get the error and a new loop starts")
            self._abandon(err)

    def _run(self) -> None:
        with self._cond:
            if self._thread is not threading.current_thread():
                return          # started, then not recorded (start() interrupted): the recorded loop runs
        while True:
            with self._cond:
                if self._closed:
                    break
                if not (self._tasks or self._waiting or self.active):
                    self._thread = None             # idle: the thread ends (an unused engine can be collected)
                    return
                tasks, self._tasks = list(self._tasks), deque()
            for fn, future in tasks:
                _run_task(fn, future)
            try:
                self._step()
            except BaseException as err:  # noqa: BLE001 - not pinned on one request: end the admitted ones
                log.exception("kvboost scheduler step failed; its running requests get the error")
                self._fail_admitted(_internal(err))
        self._shut_down()

    def _step(self) -> None:
        self._drop_cancelled()
        self._admit()
        self._expire_waiting()
        owners, items, want = self._plan()
        if not items:
            return
        try:
            logits = self.parts.prefill.runner.batch(items, want)
        except BaseException as err:  # noqa: BLE001 - the requests of this step fail, the engine goes on
            for owner in owners:
                self._fail(owner, err)
            return
        with messages_after():                  # the step's deltas handed over together at its end
            for owner, item, out in zip(owners, items, logits):
                try:
                    self._settle(owner, len(item[1]), out)
                except BaseException as err:  # noqa: BLE001 - this request fails, the others go on
                    self._fail(owner, err)

    def _drop_cancelled(self) -> None:
        for decoding in [d for d in self._decoding if d.request.cancel.is_set()]:
            self._decoding.remove(decoding)
            _guarded(decoding, lambda d=decoding: d.finish("cancelled"))
        for pre in [p for p in self._prefilling if p.request.cancel.is_set()]:
            self._prefilling.remove(pre)
            pre.assembled.sequence.release()
            _cancelled(pre.request)
        with self._cond:
            cancelled = [r for r in self._waiting if r.cancel.is_set()]
            for request in cancelled:
                self._waiting.remove(request)
        for request in cancelled:
            _cancelled(request)

    # ---- admission ----------------------------------------------------------------------
    def _admit(self) -> None:
        while self.active < self.max_running:
            with self._cond:
                if not self._waiting:
                    return
                request = self._waiting[0]
            try:
                if continues_a_prefill(self.parts.prefill, request, [p.request for p in self._prefilling]):
                    return
                assembled = assemble(self.parts.prefill, request.prompt, request.params.max_new_tokens)
            except BudgetError as err:
                if self.active and time.perf_counter() - request.started < self.queue_timeout_s:
                    return                                          # wait for running requests to finish
                self._pop(request)
                busy = QueueFullError(str(err)) if self.active else err     # KV room held by running requests
                _refuse(request, busy, waited=time.perf_counter() - request.started)
                continue
            except BaseException as err:  # noqa: BLE001 - handed to the caller
                self._pop(request)
                _refuse(request, err)
                continue
            self._pop(request)
            self._start(request, assembled)

    def _expire_waiting(self) -> None:
        """Requests that waited longer than queue_timeout_s for a running slot get a BudgetError."""
        if self.active < self.max_running:
            return                          # a slot is free: the head waits for KV room or a prefill it continues
        now = time.perf_counter()
        with self._cond:
            expired = [r for r in self._waiting if now - r.started >= self.queue_timeout_s]
            for request in expired:
                self._waiting.remove(request)
        for request in expired:
            _refuse(request, QueueFullError(f"every running slot stayed busy (max_running={self.max_running})"),
                    waited=now - request.started)

    def _pop(self, request: Request) -> None:
        with self._cond:
            self._waiting.remove(request)

    def _start(self, request: Request, assembled: Assembled) -> None:
        if not assembled.moved:
            self._prefilling.append(Prefilling(request, assembled))
            return
        self._repairing += 1                # active until it decodes (or ended); a reply made at once is
        with messages_after():              # handed over after that (a caller holding it reads active 0)
            try:                            # moved spans: the repair runs on its own
                try:
                    done = repair(self.parts.prefill, assembled)
                except BaseException as err:  # noqa: BLE001
                    assembled.sequence.release()
                    _refuse(request, err)
                    return
                self._decode(request, done)
            finally:
                self._repairing -= 1

    def _decode(self, request: Request, done) -> None:
        decoding = Decoding(self.parts, request, done)
        try:
            decoding.begin(done)
        except BaseException as err:  # noqa: BLE001
            decoding.fail(err)
            return
        if not decoding.finished:
            self._decoding.append(decoding)

    # ---- steps --------------------------------------------------------------------------
    def _plan(self) -> tuple[list, list, list]:
        return plan_step(self._decoding, self._prefilling, self.max_batch_tokens,
                         self.parts.prefill.config.prefill_chunk_tokens)

    def _settle(self, owner, computed: int, logits) -> None:
        if isinstance(owner, Decoding):
            owner.advance(logits)
            if owner.finished:
                self._decoding.remove(owner)
            return
        owner.cursor += computed
        if owner.cursor == len(owner.request.prompt):
            done = prefilled(owner.assembled, logits)
            try:
                self._decode(owner.request, done)
            finally:                                # counted as active until it decodes (or ended)
                self._prefilling.remove(owner)

    def _fail(self, owner, err: BaseException) -> None:
        """End one admitted request with `err` (whatever state it is in) and free its blocks."""
        if isinstance(owner, Decoding):
            if owner in self._decoding:
                self._decoding.remove(owner)
            owner.fail(err)
            return
        if owner in self._prefilling:
            self._prefilling.remove(owner)
        owner.assembled.sequence.release()
        _refuse(owner.request, err)

    def _fail_admitted(self, err: BaseException) -> None:
        for owner in [*self._decoding, *self._prefilling]:
            try:
                self._fail(owner, err)
            except BaseException:  # noqa: BLE001 - keep ending the others
                log.exception("kvboost scheduler could not end a request cleanly")
        self._decoding.clear()
        self._prefilling.clear()

    def _abandon(self, err: BaseException) -> None:
        """The loop itself failed: end everything it held, then let the next request start a new loop."""
        self._fail_admitted(_internal(err))
        with self._cond:
            waiting, self._waiting = list(self._waiting), deque()
            tasks, self._tasks = list(self._tasks), deque()
            self._thread = None
        for request in waiting:
            _refuse(request, _internal(err))
        for _, future in tasks:
            future.set_exception(_internal(err))

    def _shut_down(self) -> None:
        closed = KVBoostError("this engine is closed")
        self._fail_admitted(closed)
        with self._cond:
            waiting, self._waiting = list(self._waiting), deque()
            tasks, self._tasks = list(self._tasks), deque()
        for request in waiting:
            _refuse(request, closed)
        for _, future in tasks:
            future.set_exception(closed)

