"""Running the app on uvicorn: in the foreground (`python -m kvboost_engine.serve`) or on a thread
(tests, notebooks, an app that embeds the server).

Shutdown drains: on SIGTERM/SIGINT (or `stop()`), the app's draining flag is set first, so a request
that reaches the app from then on gets 503; uvicorn stops listening (new connections are refused),
closes idle keep-alive connections at once, and waits up to `drain_timeout_s` for the requests in
flight to finish; those still running a second before it (CUT_MARGIN_S) are stopped in the engine
and answered 503 (an `error` event where a stream has begun), then their connections close.
"""
from __future__ import annotations

import asyncio
import socket
import threading
import time

import uvicorn

from .pump import cut_off

DRAIN_TIMEOUT_S = 30
CUT_MARGIN_S = 1.0      # before the drain timeout, the requests left are stopped and answered (at most half of it)


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, raising the app's draining flag on the exit signal."""

    def __init__(self, config: uvicorn.Config, state):
        super().__init__(config)
        self._state = state

    def handle_exit(self, sig, frame) -> None:
        self._state.draining = True
        super().handle_exit(sig, frame)
        self._captured_signals.clear()      # drained: exit normally (the caller closes the engine), not by the signal

    async def shutdown(self, sockets=None) -> None:
        """uvicorn's drain, with the requests still in flight stopped CUT_MARGIN_S before its timeout,
        so each handler ends its own reply (503, or an `error` event in a stream begun) instead of
        uvicorn cancelling it mid-await (a plain-text 500, "Exception in ASGI application" logged)."""
        self._state.draining = True
        timeout = self.config.timeout_graceful_shutdown
        cut = None if timeout is None else asyncio.get_running_loop().call_later(
            max(0.0, timeout - min(CUT_MARGIN_S, timeout / 2)), cut_off, self._state.inflight)
        try:
            await super().shutdown(sockets)
        finally:
            if cut is not None:
                cut.cancel()


class Server:
    """`create_app(...)`'s app on `host:port` (port 0: a free one; `.port`, `.url` tell which).

    `serve()` runs in the foreground until a signal; `start()` on a daemon thread (returns once it
    listens), `stop()` drains and joins it; also a context manager (start/stop)."""

    def __init__(self, app, *, host: str = "127.0.0.1", port: int = 0, drain_timeout_s: int = DRAIN_TIMEOUT_S,
                 log_level: str = "warning"):
        self.app = app
        self._socket = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.host = host
        self.port = self._socket.getsockname()[1]
        config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=drain_timeout_s,
                                lifespan="off")
        self._uvicorn = _Uvicorn(config, app.state.kvboost)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The OpenAI base URL: http://host:port/v1."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def serve(self) -> None:
        """Serve in this thread until SIGTERM/SIGINT, then drain."""
        self._uvicorn.run(sockets=[self._socket])

    def start(self, timeout_s: float = 30.0) -> "Server":
        self._thread = threading.Thread(target=self.serve, name="kvboost-serve", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.01)
        return self

    def drain(self) -> None:
        """Refuse new requests (503) and let uvicorn stop once those in flight finished (as SIGTERM)."""
        self.app.state.kvboost.draining = True
        self._uvicorn.should_exit = True

    def stop(self, timeout_s: float | None = None) -> None:
        """Drain and wait for the server thread to end."""
        self.drain()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._socket.close()

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
