"""Sending one request: the replicas in the router's order until one answers, then its stream.

`Dispatcher.run` (sync generator: text deltas, returns the RemoteGeneration) and `arun` (async
generator: text deltas, then the RemoteGeneration) share everything but the awaits. Before the
first response arrives, a replica that is unreachable, times out or answers 5xx/429 is marked
down and the next candidate is tried; a bad request (4xx) is raised at once. Once text has been
streamed, an error is raised as is (a reply cannot be resumed on another replica).
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Generator
from dataclasses import dataclass

from kvboost_engine import KVBoostError

from .client import Replica, is_replica_failure
from .generation import RemoteGeneration, ReplyState
from .routing import Router
from .telemetry import CacheReport


class ReplicaUnavailableError(KVBoostError, ConnectionError):
    """No replica answered a request (each was unreachable, timed out or failed)."""


@dataclass
class _Attempt:
    name: str
    replica: Replica
    stream: object
    failed: list[str]
    started: float
    counters_before: object = None


class Dispatcher:
    """Replicas, their router and the cache report, and the request loop over them."""

    def __init__(self, replicas: dict[str, Replica], router: Router, report: CacheReport):
        self.replicas = replicas
        self.router = router
        self.report = report

    def run(self, key: int, kind: str, body: dict, cancel: threading.Event) -> Generator[str, None, RemoteGeneration]:
        """Stream a "chat" or "completion" request routed by `key`; stops early once `cancel` is set."""
        attempt = self._open(key, kind, body)
        reply = ReplyState(attempt.started)
        feed = reply.feed_chat if kind == "chat" else reply.feed_completion
        cancelled = False
        try:
            with attempt.stream as chunks:
                for chunk in chunks:
                    delta = feed(chunk)
                    if delta:
                        yield delta
                    if cancel.is_set():
                        cancelled = True
                        break
        finally:
            self.router.end(attempt.name)
        after = attempt.replica.prefix_counters() if attempt.counters_before is not None else None
        return self._finish(attempt, reply, body["model"], cancelled, after)

    async def arun(self, key: int, kind: str, body: dict) -> AsyncIterator[str | RemoteGeneration]:
        """`run` through the async client: text deltas, then the RemoteGeneration."""
        attempt = await self._aopen(key, kind, body)
        reply = ReplyState(attempt.started)
        feed = reply.feed_chat if kind == "chat" else reply.feed_completion
        try:
            async with attempt.stream as chunks:
                async for chunk in chunks:
                    delta = feed(chunk)
                    if delta:
                        yield delta
        finally:
            self.router.end(attempt.name)
        after = None
        if attempt.counters_before is not None:
            after = await asyncio.to_thread(attempt.replica.prefix_counters)
        yield self._finish(attempt, reply, body["model"], False, after)

    def _open(self, key: int, kind: str, body: dict) -> _Attempt:
        started = None          # TTFT counts failed attempts, not the first telemetry baseline
        failed, errors = [], []
        for name in self.router.candidates(key):
            replica = self.replicas[name]
            before = self._counters_before(replica)
            started = started or time.perf_counter()
            self.router.begin(name)
            try:
                client = replica.client
                create = client.chat.completions.create if kind == "chat" else client.completions.create
                return _Attempt(name, replica, create(**body), failed, started, before)
            except Exception as err:
                self.router.end(name)
                self._failed(name, err, failed, errors)
        raise ReplicaUnavailableError("no replica answered: " + "; ".join(errors))

    async def _aopen(self, key: int, kind: str, body: dict) -> _Attempt:
        started = None
        failed, errors = [], []
        for name in self.router.candidates(key):
            replica = self.replicas[name]
            before = await asyncio.to_thread(self._counters_before, replica)
            started = started or time.perf_counter()
            self.router.begin(name)
            try:
                client = replica.aclient
                create = client.chat.completions.create if kind == "chat" else client.completions.create
                return _Attempt(name, replica, await create(**body), failed, started, before)
            except Exception as err:
                self.router.end(name)
                self._failed(name, err, failed, errors)
        raise ReplicaUnavailableError("no replica answered: " + "; ".join(errors))

    def any_replica(self, call):
        """`call(replica)` on the first replica that answers (for lookups any replica can do)."""
        failed, errors = [], []
        for name in self.router.candidates(0):
            try:
                return call(self.replicas[name])
            except Exception as err:
                self._failed(name, err, failed, errors)
        raise ReplicaUnavailableError("no replica answered: " + "; ".join(errors))

    def _counters_before(self, replica: Replica):
        """Take the report's baseline on first use; per-request counters if usage lacks cached tokens."""
        if self.report.needs_baseline(replica.url):
            self.report.set_baseline(replica.url, replica.prefix_counters())
        return replica.prefix_counters() if replica.reports_cached_tokens is False else None

    def _failed(self, name: str, err: Exception, failed: list[str], errors: list[str]) -> None:
        if not is_replica_failure(err):
            raise err
        self.router.mark_down(name)
        self.report.failed(name)
        failed.append(name)
        errors.append(f"{name}: {type(err).__name__}: {err}")

    def _finish(self, attempt: _Attempt, reply: ReplyState, model: str, cancelled: bool, after) -> RemoteGeneration:
        if reply.usage is not None and attempt.replica.reports_cached_tokens is None:
            attempt.replica.reports_cached_tokens = reply.cached_tokens() is not None
        metrics_cached = None
        if after is not None and attempt.counters_before is not None:
            metrics_cached = int((after - attempt.counters_before).hits)
        gen = reply.generation(replica=attempt.name, model=model, cancelled=cancelled,
                               failovers=attempt.failed, metrics_cached=metrics_cached)
        self.report.add(attempt.name, gen.prompt_tokens, gen.server.get("cached_tokens"), gen.ttft_s)
        return gen
