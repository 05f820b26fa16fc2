"""Running the app on uvicorn: in the foreground (`python -m kvboost_engine.serve`) or on a thread
(tests, notebooks, an app that embeds the server).

Shutdown drains: on SIGTERM/SIGINT (or `stop()`), the app's draining flag is set first, so a request
that reaches the app from then on gets 503; uvicorn stops listening (new connections are refused),
closes idle keep-alive connections at once, and waits up to `drain_timeout_s` for the requests in
flight to finish; those still running then are stopped in the engine and answered 503 (an `error`
event where a stream has begun), then their connections close.
"""
from __future__ import annotations

import asyncio
import socket
import threading
import time

import uvicorn

from .pump import cut_off

DRAIN_TIMEOUT_S = 30
CUT_GRACE_S = 10        # after the drain timeout's cut, how long the requests left have to answer before uvicorn cancels them


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, raising the app's draining flag on the exit signal."""

    def __init__(self, config: uvicorn.Config, state, drain_s: float):
        super().__init__(config)
        self._state, self._drain_s = state, drain_s

    def handle_exit(self, sig, frame) -> None:
        self._state.draining = True
        super().handle_exit(sig, frame)
        self._captured_signals.clear()      # drained: exit normally (the caller closes the engine), not by the signal

    async def shutdown(self, sockets=None) -> None:
        """uvicorn's drain; at the drain timeout the requests still in flight are stopped, and each handler
        ends its own reply (503, or an `error` event in a stream begun) within the step the engine is in,
        instead of uvicorn cancelling it mid-await (a plain-text 500, "Exception in ASGI application"
        logged): uvicorn's own timeout is CUT_GRACE_S later, for what still has not ended then."""
        self._state.draining = True
        cut = None if self._drain_s is None else \
            asyncio.get_running_loop().call_later(self._drain_s, cut_off, self._state.inflight)
        try:
            await super().shutdown(sockets)
        finally:
            if cut is not None:
                cut.cancel()


def listen_socket(host: str, port: int) -> socket.socket:
    """A socket listening on host:port (OSError when the port is taken or the host is not ours;
    OverflowError for a port out of range): `serve` takes it before loading a model for minutes."""
    return socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)


class Server:
    """`create_app(...)`'s app on `host:port` (port 0: a free one; `.port`, `.url` tell which).

    `serve()` runs in the foreground until a signal; `start()` on a daemon thread (returns once it
    listens), `stop()` drains and joins it; also a context manager (start/stop)."""

    def __init__(self, app, *, host: str = "127.0.0.1", port: int = 0, drain_timeout_s: float | None = DRAIN_TIMEOUT_S,
                 log_level: str = "warning", sock: socket.socket | None = None):
        self.app = app
        self._socket = sock if sock is not None else listen_socket(host, port)     # sock: bound before (listen_socket)
        self.host = self._socket.getsockname()[0]
        self.port = self._socket.getsockname()[1]
        grace = None if drain_timeout_s is None else drain_timeout_s + CUT_GRACE_S     # None: wait as long as they run
        config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=grace, lifespan="off")
        self._uvicorn = _Uvicorn(config, app.state.kvboost, drain_timeout_s)
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
