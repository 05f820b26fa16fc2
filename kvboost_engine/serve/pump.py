"""An engine stream read on its own thread and handed to the event loop, event by event.

The engine's `GenerationStream` blocks between tokens; the event loop must not. `Pump` reads the
stream on a thread of its own (one per request; the engine refuses requests beyond its queue, which
bounds them) and passes ("delta", text), ("end", Generation) or ("error", exception) to an asyncio
queue. `cancel()` stops the request in the engine (from the loop, at once); the thread then reads
the stream to its end, so the request's KV is stored and its blocks are freed, and hands the end
(its Generation, None after an error) to `on_end`, however the response ended (metrics count it).
A pump is in its `inflight` set until then; `cut_off(inflight)` stops them all when a drain runs out.
"""
from __future__ import annotations

import asyncio
import threading
import time

from ..request.generation import Generation, GenerationStream

POLL_S = 0.25           # how often a wait for the next event checks whether the client is still there


class Pump:
    """Events of one engine stream, awaited from the event loop."""

    def __init__(self, stream: GenerationStream, started: float, on_end=None, inflight: Inflight | None = None):
        self.stream = stream
        self.started = started
        self.first_at: float | None = None
        self.generation: Generation | None = None
        self.cut = False                                # cut_off() stopped it (the drain's deadline)
        self._on_end = on_end
        self._inflight = inflight if inflight is not None else Inflight()
        self._inflight.add(self)
        if self._inflight.cut:                          # made after the cut (its body was still arriving)
            self.cut = True
            stream.cancel()
        self._checked = time.perf_counter()         # when `gone` was last asked
        try:
            self._loop = asyncio.get_running_loop()
            self._queue: asyncio.Queue = asyncio.Queue()
            self._thread = threading.Thread(target=self._run, name="kvboost-serve-stream", daemon=True)
            self._thread.start()
        except BaseException:                       # no thread will end it: out of the set, the request stopped
            self._inflight.discard(self)
            stream.cancel()
            raise

    def _run(self) -> None:
        ended = None
        try:
            for delta in self.stream:
                self._put(("delta", delta))
            ended = self.stream.generation
            last = ("end", ended)
        except BaseException as err:  # noqa: BLE001 - handed to the request's handler
            last = ("error", err)
        try:
            if self._on_end is not None:
                self._on_end(ended)             # before the reply can go out: /metrics agrees with it
        finally:
            self._inflight.discard(self)
            self._put(last)

    def _put(self, event: tuple) -> None:
        if self.first_at is None:
            self.first_at = time.perf_counter()
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:            # the loop is gone (the server stopped): nobody reads any more
            self.stream.cancel()

    async def next(self, gone=None) -> tuple:
        """The next event; `gone` (an async callable) is asked every POLL_S (tokens arriving or not)
        whether the client left, and if it did the request is cancelled and ("gone", None) returned."""
        while True:
            if gone is not None and time.perf_counter() - self._checked >= POLL_S:
                self._checked = time.perf_counter()
                if await gone():
                    self.cancel()
                    return ("gone", None)
            try:
                event = await asyncio.wait_for(self._queue.get(), POLL_S)
            except asyncio.TimeoutError:
                continue
            if event[0] == "end":
                self.generation = event[1]
            return event

    def cancel(self) -> None:
        """Stop the request (the thread finishes reading; KV stored, blocks freed)."""
        self.stream.cancel()

    @property
    def cut_short(self) -> bool:
        """Whether the request ended because cut_off() stopped it (not because it finished first)."""
        return self.cut and self.generation is not None and self.generation.finish_reason == "cancelled"

    def join(self, timeout: float | None = None) -> None:
        """Wait for the reading thread (tests and shutdown)."""
        self._thread.join(timeout)


CUT_MESSAGE = "the server shut down before this reply finished (its drain timeout passed); retry on another server"


class Inflight(set):
    """The pumps of the requests in flight; `cut` once cut_off ran (a pump made later is stopped at once)."""

    cut = False


def cut_off(inflight: Inflight) -> None:
    """Stop every request in flight (the server's drain timeout passed): each one's handler then ends its
    reply itself (503, or an `error` event in a stream begun), rather than being cancelled by uvicorn
    mid-await (a plain-text 500 and a traceback in the log)."""
    inflight.cut = True
    for pump in list(inflight):
        pump.cut = True
        pump.cancel()
