"""Continuous batching: every request of an engine runs on one scheduler thread, in shared forwards.

Each step is one forward over the next token of every decoding request plus, within a token
budget (`max_batch_tokens`), a chunk of the prompts still being prefilled (chunked prefill): the
weights are read once for all of them, each sequence attends over its own block table (shared
prefix blocks mapped, not copied), and a long prompt never holds the others' decoding for more
than one chunk. Requests come from any thread or event loop (`submit`); their results come back
through their Channel.

Admission: a request joins when its KV can be reserved. One that fits the pool alone but not next
to the running ones waits (a bounded queue, `max_waiting`, for at most `queue_timeout_s`), then
gets a clear BudgetError; one that cannot fit even alone is refused at once. A request whose
prompt continues a prompt still being prefilled waits for it to be stored, so concurrent chats
over one system prompt hold its blocks once.
"""
from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future

import torch

from ..errors import BudgetError, KVBoostError
from ..kv.tree import common_prefix
from .decode import Decoding, EngineParts, Request
from .generation import Generation
from .openmp import release_thread_pool
from .prefill import Assembled, assemble, prefilled, repair


class _Prefilling:
    """A request whose prompt is computed chunk by chunk in batch steps."""

    __slots__ = ("request", "assembled", "cursor")

    def __init__(self, request: Request, assembled: Assembled):
        self.request, self.assembled, self.cursor = request, assembled, assembled.start


_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """At interpreter exit, stop every scheduler between two steps (not inside a forward)."""
    for scheduler in list(_LIVE):
        scheduler.close()


class Scheduler:
    def __init__(self, parts: EngineParts, *, max_running: int, max_batch_tokens: int, max_waiting: int,
                 queue_timeout_s: float):
        self.parts = parts
        self.max_running, self.max_batch_tokens = max_running, max_batch_tokens
        self.max_waiting, self.queue_timeout_s = max_waiting, queue_timeout_s
        self._waiting: deque[Request] = deque()
        self._prefilling: list[_Prefilling] = []
        self._decoding: list[Decoding] = []
        self._tasks: deque[tuple] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        _LIVE.add(self)

    # ---- callers ------------------------------------------------------------------------
    def submit(self, request: Request) -> None:
        """Queue a request; its deltas and result arrive through request.channel."""
        self._check_fits_alone(request)
        with self._cond:
            self._check_open()
            if len(self._waiting) >= self.max_waiting:
                raise BudgetError(f"{len(self._waiting)} requests are already waiting for KV room "
                                  f"(max_waiting={self.max_waiting}); try again later")
            self._waiting.append(request)
            self._start_thread()
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            release_thread_pool()           # the caller now waits: its idle OpenMP workers would slow ours

    def call(self, fn):
        """Run `fn()` on the scheduler thread between two steps and return its result."""
        if threading.current_thread() is self._thread:
            return fn()                     # already there (an observer calling back): no self-wait
        future: Future = Future()
        with self._cond:
            self._check_open()
            self._tasks.append((fn, future))
            self._start_thread()
            self._cond.notify()
        return future.result()

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
        """Requests admitted and not finished."""
        return len(self._prefilling) + len(self._decoding)

    def _check_open(self) -> None:
        if self._closed:
            raise KVBoostError("this engine is closed")

    def _start_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="kvboost-scheduler", daemon=True)
            self._thread.start()

    def _check_fits_alone(self, request: Request) -> None:
        if not self.parts.prefill.config.paged:
            return                                  # contiguous requests bring their own buffers
        pool, cache = self.parts.prefill.cache.pool, self.parts.prefill.cache
        need = -(-(len(request.prompt) + request.params.max_new_tokens) // pool.block_tokens)
        room = pool.total_blocks - cache.budget.pinned_bytes // pool.block_bytes
        if need > room:
            raise BudgetError(f"request refused before any work: it needs KV for "
                              f"{len(request.prompt) + request.params.max_new_tokens} positions ({need} blocks of "
                              f"{pool.block_tokens} tokens) but the KV pool holds {room} blocks next to pinned "
                              f"chunks ({pool.total_blocks * pool.block_bytes} bytes in all)")

    # ---- the loop -----------------------------------------------------------------------
    def _loop(self) -> None:
        with torch.inference_mode():        # grad mode is per thread: KV made inside or outside one works
            self._run()

    def _run(self) -> None:
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
            self._step()
        self._shut_down()

    def _step(self) -> None:
        self._drop_cancelled()
        self._admit()
        owners, items, want = self._plan()
        if not items:
            return
        try:
            logits = self.parts.prefill.runner.batch(items, want)
        except BaseException as err:  # noqa: BLE001 - the requests of this step fail, the engine goes on
            for owner in owners:
                self._fail(owner, err)
            return
        for owner, item, out in zip(owners, items, logits):
            self._settle(owner, len(item[1]), out)

    def _drop_cancelled(self) -> None:
        for decoding in [d for d in self._decoding if d.request.cancel.is_set()]:
            decoding.finish("cancelled")
            self._decoding.remove(decoding)
        for pre in [p for p in self._prefilling if p.request.cancel.is_set()]:
            pre.assembled.sequence.release()
            self._prefilling.remove(pre)
            _cancelled(pre.request)
        with self._cond:
            for request in [r for r in self._waiting if r.cancel.is_set()]:
                self._waiting.remove(request)
                _cancelled(request)

    # ---- admission ----------------------------------------------------------------------
    def _admit(self) -> None:
        while self.active < self.max_running:
            with self._cond:
                if not self._waiting:
                    return
                request = self._waiting[0]
            if self._continues_a_prefill(request):
                return
            try:
                assembled = assemble(self.parts.prefill, request.prompt, request.params.max_new_tokens)
            except BudgetError as err:
                if self.active and time.perf_counter() - request.started < self.queue_timeout_s:
                    return                                          # wait for running requests to finish
                self._pop(request)
                _refuse(request, err, waited=time.perf_counter() - request.started)
                continue
            except BaseException as err:  # noqa: BLE001 - handed to the caller
                self._pop(request)
                _refuse(request, err)
                continue
            self._pop(request)
            self._start(request, assembled)

    def _pop(self, request: Request) -> None:
        with self._cond:
            self._waiting.remove(request)

    def _continues_a_prefill(self, request: Request) -> bool:
        """Whether a prompt still being prefilled covers more of this one than the cache does
        (then this one waits for it to be stored and maps its blocks instead of computing them)."""
        if not self._prefilling:
            return False
        tokens = request.prompt.token_ids
        shared = max(common_prefix(tuple(p.request.prompt.token_ids), tokens, 0) for p in self._prefilling)
        cached = self.parts.prefill.cache.cached_prefix(tokens, len(tokens) - 1)
        return shared > cached + self.parts.prefill.cache.block_tokens

    def _start(self, request: Request, assembled: Assembled) -> None:
        if not assembled.moved:
            self._prefilling.append(_Prefilling(request, assembled))
            return
        try:                                                    # moved spans: the repair runs on its own
            done = repair(self.parts.prefill, assembled)
        except BaseException as err:  # noqa: BLE001
            assembled.sequence.release()
            _refuse(request, err)
            return
        self._decode(request, done)

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
        """Who runs this step: every decoding request (one token each), then prompt chunks."""
        owners, items, want = [], [], []
        for decoding in self._decoding:
            owners.append(decoding)
            items.append(decoding.next_input())
            want.append(True)
        budget = self.max_batch_tokens - len(items)
        # Shortest remaining prompt first: a short request arriving during a long prefill rides the
        # next chunk's forward (its TTFT is one chunk, not the whole long prompt).
        for pre in sorted(self._prefilling, key=lambda p: len(p.request.prompt) - p.cursor):
            if budget <= 0:
                break
            n = len(pre.request.prompt)
            take = min(budget, self.parts.prefill.config.prefill_chunk_tokens, n - pre.cursor)
            owners.append(pre)
            items.append((pre.assembled.sequence, pre.request.prompt.token_ids[pre.cursor:pre.cursor + take],
                          pre.cursor))
            want.append(pre.cursor + take == n)
            budget -= take
        return owners, items, want

    def _settle(self, owner, computed: int, logits) -> None:
        if isinstance(owner, Decoding):
            try:
                owner.advance(logits)
            except BaseException as err:  # noqa: BLE001
                owner.fail(err)
            if owner.finished:
                self._decoding.remove(owner)
            return
        owner.cursor += computed
        if owner.cursor == len(owner.request.prompt):
            self._prefilling.remove(owner)
            self._decode(owner.request, prefilled(owner.assembled, logits))

    def _fail(self, owner, err: BaseException) -> None:
        if isinstance(owner, Decoding):
            owner.fail(err)
            self._decoding.remove(owner)
        else:
            owner.assembled.sequence.release()
            self._prefilling.remove(owner)
            _refuse(owner.request, err)

    def _shut_down(self) -> None:
        closed = KVBoostError("this engine is closed")
        for decoding in list(self._decoding):
            decoding.finish("cancelled")
        for pre in list(self._prefilling):
            pre.assembled.sequence.release()
            _refuse(pre.request, closed)
        with self._cond:
            waiting, self._waiting = list(self._waiting), deque()
            tasks, self._tasks = list(self._tasks), deque()
        for request in waiting:
            _refuse(request, closed)
        for _, future in tasks:
            future.set_exception(closed)
        self._decoding.clear()
        self._prefilling.clear()


def _run_task(fn, future: Future) -> None:
    try:
        future.set_result(fn())
    except BaseException as err:  # noqa: BLE001 - handed to the caller
        future.set_exception(err)


def _refuse(request: Request, err: BaseException, waited: float | None = None) -> None:
    if waited is not None and isinstance(err, BudgetError):
        err = BudgetError(f"{err} (waited {waited:.1f} s for running requests to free KV room)")
    gen = Generation(prompt_tokens=len(request.prompt), finish_reason="error")
    request.on_done(gen)
    request.channel.error(err)


def _cancelled(request: Request) -> None:
    gen = Generation(prompt_tokens=len(request.prompt), finish_reason="cancelled")
    request.on_done(gen)
    request.channel.done(gen)
