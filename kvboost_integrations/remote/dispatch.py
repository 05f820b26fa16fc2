"""Sending one request: the replicas in the router's order until one gives a complete reply.

`Dispatcher.run` (sync generator: text deltas, returns the RemoteGeneration) and `arun` (async
generator: text deltas, then the RemoteGeneration) share everything but the awaits. The rules:

- a reply is complete only when a chunk carries its finish_reason; a stream that ends without
  one is a failure, never a shorter answer; one that breaks after it is complete (its usage lost);
- a stream the engine's close() cut is EngineClosedError, the replica not marked down;
- until the first text delta has been handed to the caller, a replica failure (unreachable,
  timed out, 5xx/429, a dropped stream, a malformed chunk, a body that is not JSON; its
  /metrics call included) marks the replica down and the next candidate is tried; if none
  answers, `ReplicaUnavailableError` says what happened at each;
- after it, the failure marks the replica down and raises `ReplyInterruptedError` naming the
  replica (a reply cannot be resumed on another one);
- a bad request (another 4xx) is raised at once; a replica that answers is marked up.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Generator
from dataclasses import dataclass, field

from kvboost_engine import RequestTimeoutError

from .client import Replica, describe_failure, is_replica_failure
from .cutoff import Cutoff, Deadline, attempt_client
from .errors import EngineClosedError, ReplicaUnavailableError, ReplyInterruptedError
from .generation import RemoteGeneration, ReplyState
from .routing import Router
from .telemetry import CacheReport

__all__ = ["Dispatcher", "ReplicaUnavailableError"]

log = logging.getLogger(__name__)


@dataclass
class _Request:
    """One request across its attempts: when it started, which replicas failed and how."""

    started: float = field(default_factory=time.perf_counter)
    errors: dict[str, str] = field(default_factory=dict)

    def unavailable(self) -> ReplicaUnavailableError:
        what = "; ".join(f"{name}: {error}" for name, error in self.errors.items())
        return ReplicaUnavailableError(f"no replica answered: {what}", errors=self.errors)


class Dispatcher:
    """Replicas, their router and the cache report, and the request loop over them."""

    def __init__(self, replicas: dict[str, Replica], router: Router, report: CacheReport,
                 timeout: float | None = None):
        self.replicas = replicas
        self.router = router
        self.report = report
        self.timeout = timeout          # the whole request's bound (the classes' `timeout`), every attempt included

    def run(self, key: int, kind: str, body: dict, cancel: threading.Event) -> Generator[str, None, RemoteGeneration]:
        """Stream a "chat" or "completion" request routed by `key`; stops early once `cancel` is set
        (at once: a read in flight is cut). Past `timeout`: RequestTimeoutError."""
        cutoff = Cutoff(self.timeout, cancel)
        try:
            return (yield from self._run(key, kind, body, cancel, cutoff))
        finally:
            cutoff.stop()

    def _run(self, key: int, kind: str, body: dict, cancel: threading.Event, cutoff: Cutoff):
        request = _Request()
        for name in self.router.candidates(key):
            if cancel.is_set():
                return RemoteGeneration(finish_reason="cancelled", failovers=list(request.errors))
            cutoff.check()
            replica, reply, cancelled = self.replicas[name], ReplyState(request.started), False
            closes = replica.closes
            self.router.begin(name)
            load = self.router.load(name)
            replica.cutoffs.add(cutoff)         # the engine's close() cuts it
            try:
                before = self._counters_before(replica)
                with _create(attempt_client(replica, cutoff.left()), kind, body) as chunks:
                    cutoff.watch(chunks)
                    try:
                        for chunk in chunks:
                            delta = reply.feed(kind, chunk)
                            if delta:
                                yield delta
                            if cancel.is_set():
                                break
                            if reply.finish_reason is None:
                                cutoff.check()  # after every chunk: empty deltas and tool-call arguments too
                    finally:
                        cutoff.unwatch()    # before the connection goes back to the pool
                cancelled = cancel.is_set()
                if not cancelled:
                    if reply.finish_reason is None:
                        cutoff.check()      # a stream the deadline's timer cut (it ended early)
                    reply.check_complete()
            except Exception as err:
                cancelled = cancel.is_set() and cutoff.reason == "cancel"
                if cutoff.reason == "timeout" and reply.finish_reason is None:
                    self._timed_out(name, reply)
                    raise cutoff.deadline.error() from err
                if not cancelled and not _done_anyway(name, err, reply):
                    self._attempt_failed(name, err, reply, request, closes)
                    continue
            finally:
                replica.cutoffs.discard(cutoff)
                self.router.end(name)
            after = replica.prefix_counters() if before is not None else None
            return self._finish(name, reply, request, body["model"], cancelled, (before, after), load)
        cutoff.check()                      # the last attempt ran out of time: a timeout, as the others
        raise request.unavailable()

    async def arun(self, key: int, kind: str, body: dict) -> AsyncIterator[str | RemoteGeneration]:
        """`run` through the async client: text deltas, then the RemoteGeneration."""
        request = _Request()
        deadline = Deadline(self.timeout)
        for name in self.router.candidates(key):
            deadline.check()
            replica, reply = self.replicas[name], ReplyState(request.started)
            closes = replica.closes
            self.router.begin(name)
            load = self.router.load(name)
            try:
                before = await asyncio.to_thread(self._counters_before, replica)
                opened = _create(attempt_client(replica, deadline.left(), asynchronous=True), kind, body)
                try:                        # the response's start within the deadline too
                    stream = await asyncio.wait_for(opened, deadline.left())
                except asyncio.TimeoutError:
                    raise deadline.error() from None
                async with stream as chunks:
                    chunks = aiter(chunks)
                    while True:             # each chunk within what is left of the deadline
                        try:
                            chunk = await asyncio.wait_for(anext(chunks), deadline.left())
                        except StopAsyncIteration:
                            break
                        except asyncio.TimeoutError:
                            raise deadline.error() from None
                        delta = reply.feed(kind, chunk)
                        if delta:
                            yield delta
                reply.check_complete()
            except RequestTimeoutError:
                self._timed_out(name, reply)
                raise
            except Exception as err:
                if not _done_anyway(name, err, reply):
                    self._attempt_failed(name, err, reply, request, closes)
                    continue
            finally:
                self.router.end(name)
            after = await asyncio.to_thread(replica.prefix_counters) if before is not None else None
            yield self._finish(name, reply, request, body["model"], False, (before, after), load)
            return
        deadline.check()                    # the last attempt ran out of time: a timeout, as the others
        raise request.unavailable()

    def _timed_out(self, name: str, reply: ReplyState) -> None:
        """The request's deadline passed at `name`: a replica that sent no text in all that time
        is tried last for a while, as a read timeout would have it (a slow reply is not a fault)."""
        if not reply.delivered:
            self.router.mark_down(name)
            self.report.failed(name)

    def any_replica(self, call):
        """`call(replica)` on the first replica that answers (for lookups any replica can do)."""
        request = _Request()
        for name in self.router.candidates(0):
            closes = self.replicas[name].closes
            try:
                result = call(self.replicas[name])
            except Exception as err:
                self._attempt_failed(name, err, ReplyState(request.started), request, closes)
                continue
            self.router.mark_up(name)
            return result
        raise request.unavailable()

    def _counters_before(self, replica: Replica):
        """Take the report's baseline on first use; per-request counters if usage lacks cached tokens.
        A replica that cannot be reached or times out here fails the attempt (strict)."""
        if self.report.needs_baseline(replica.url):
            self.report.set_baseline(replica.url, replica.prefix_counters(strict=True))
        return replica.prefix_counters(strict=True) if replica.reports_cached_tokens is False else None

    def _attempt_failed(self, name: str, err: Exception, reply: ReplyState, request: _Request, closes: int) -> None:
        """Mark a failing replica down and note why; raise what the caller must see: a bad request
        as it is, a failure after text reached the caller as ReplyInterruptedError. A replica closed
        under the call (the engine's close() since `closes` was read) is not failing: EngineClosedError."""
        if not is_replica_failure(err):
            raise err
        if self.replicas[name].closes != closes:
            raise EngineClosedError(f"the remote engine was closed during this request (replica {name}); "
                                    f"{reply.received_chars} characters of its reply had reached the caller") from err
        self.router.mark_down(name)
        self.report.failed(name)
        what = describe_failure(err, self.replicas[name])
        if reply.delivered:
            raise ReplyInterruptedError(
                f"replica {name} failed after {reply.received_chars} characters of its reply had reached the caller: "
                f"{what}. The reply is incomplete (it cannot be resumed on another replica); the replica is marked "
                f"down for cooldown_s={self.router.cooldown_s:g} s", replica=name,
                received_chars=reply.received_chars) from err
        request.errors[name] = what

    def _finish(self, name: str, reply: ReplyState, request: _Request, model: str, cancelled: bool,
                counters: tuple, load: tuple[int, int]) -> RemoteGeneration:
        replica = self.replicas[name]
        self.router.mark_up(name)
        if reply.usage is not None and replica.reports_cached_tokens is None:
            replica.reports_cached_tokens = reply.cached_tokens() is not None
        before, after = counters
        alone = load[0] == 1 and self.router.load(name) == (0, load[1])   # else the counters mix requests
        metrics_cached = int((after - before).hits) if alone and before is not None and after is not None else None
        gen = reply.generation(replica=name, model=model, cancelled=cancelled,
                               failovers=list(request.errors), metrics_cached=metrics_cached)
        self.report.add(name, gen.prompt_tokens, gen.server.get("cached_tokens"), gen.ttft_s)
        return gen


def _done_anyway(name: str, err: Exception, reply: ReplyState) -> bool:
    """Whether a stream that broke after a chunk carried its finish_reason is a complete reply all the
    same (the server said it was done; what was lost is the usage chunk or the end of the stream)."""
    if reply.finish_reason is None or not is_replica_failure(err):
        return False
    log.warning("kvboost remote: replica %s's stream broke after its reply was complete (%s: %s); the reply "
                "is kept, without the server's usage", name, type(err).__name__, err)
    return True


def _create(client, kind: str, body: dict):
    """The streamed request on a sync or async client (a coroutine for the async one)."""
    create = client.chat.completions.create if kind == "chat" else client.completions.create
    return create(**body)
