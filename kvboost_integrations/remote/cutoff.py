"""Cutting a sync request short from another thread: at its deadline, on its caller's cancel, on
the engine's close.

A read blocked on a stream's socket does not wake when the response is closed from another
thread, and a server that keeps sending what is not text (empty deltas, tool-call arguments, SSE
comments) never lets a read time out. Shutting the socket down wakes the read at once (it sees
the stream end). `Cutoff` holds the socket of the attempt in flight, a timer for the request's
deadline, and why it cut; `CancelEvent` is a cancel flag that tells it when it is set.
"""
from __future__ import annotations

import socket
import threading
import time

from kvboost_engine import RequestTimeoutError


class CancelEvent(threading.Event):
    """A request's cancel flag; setting it also calls the hooks attached (its Cutoff's)."""

    def __init__(self):
        super().__init__()
        self._hooks: list = []
        self._hooks_lock = threading.Lock()

    def set(self) -> None:
        super().set()
        with self._hooks_lock:
            hooks = list(self._hooks)
        for hook in hooks:
            hook()

    def attach(self, hook) -> None:
        with self._hooks_lock:
            self._hooks.append(hook)
        if self.is_set():
            hook()

    def detach(self, hook) -> None:
        with self._hooks_lock:
            if hook in self._hooks:
                self._hooks.remove(hook)


class Deadline:
    """A request's deadline, `timeout` seconds from now (None: none); the sync and async paths' one rule."""

    def __init__(self, timeout: float | None):
        self.timeout = timeout
        self.at = None if timeout is None else time.monotonic() + timeout

    def left(self) -> float | None:
        """Seconds to the deadline (0 past it; None: no deadline)."""
        return None if self.at is None else max(0.0, self.at - time.monotonic())

    def passed(self) -> bool:
        return self.at is not None and time.monotonic() >= self.at

    def check(self) -> None:
        if self.passed():
            raise self.error()

    def error(self) -> RequestTimeoutError:
        return RequestTimeoutError(f"the request took longer than its timeout of {self.timeout:g} s "
                                   "(the classes' timeout bounds the whole request, every replica tried included)")


class Cutoff:
    """One request's cut-off. `reason`: None, "timeout", "cancel" or "closed" (the first that came).

    `timeout` (seconds from now; None: no deadline) starts a timer that cuts at the deadline.
    `watch(stream)` names the socket an attempt reads; `cut(reason)` shuts it down.
    """

    def __init__(self, timeout: float | None, cancel: threading.Event):
        self.deadline = Deadline(timeout)
        self.reason: str | None = None
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._cancel = cancel if isinstance(cancel, CancelEvent) else None
        self._timer = None
        if timeout is not None:
            self._timer = threading.Timer(timeout, self.cut, args=("timeout",))
            self._timer.daemon = True
            self._timer.start()
        if self._cancel is not None:
            self._cancel.attach(self._on_cancel)

    def _on_cancel(self) -> None:
        self.cut("cancel")

    def watch(self, stream) -> None:
        """The socket `stream` (an openai Stream) reads is the one to shut down (at once if already cut)."""
        sock = _socket_of(stream)
        with self._lock:
            self._sock = sock
            if self.reason is not None:
                _shut(sock)

    def unwatch(self) -> None:
        """The attempt's stream is done with its socket: from now on no cut reaches it (call it before
        the stream is closed, which hands the connection back to the pool for another request)."""
        with self._lock:
            self._sock = None

    def cut(self, reason: str) -> None:
        with self._lock:                # shut under the lock: never after unwatch() handed the socket on
            if self.reason is None:
                self.reason = reason
            _shut(self._sock)

    def left(self) -> float | None:
        return self.deadline.left()

    def check(self) -> None:
        """RequestTimeoutError once the deadline has passed (it cuts the attempt in flight too)."""
        if self.deadline.passed():
            self.cut("timeout")
        if self.reason == "timeout":
            raise self.deadline.error()

    def stop(self) -> None:
        """The request has ended: no timer, no hook, no socket."""
        if self._timer is not None:
            self._timer.cancel()
        if self._cancel is not None:
            self._cancel.detach(self._on_cancel)
        self.unwatch()


def attempt_client(replica, seconds: float | None, asynchronous: bool = False):
    """`replica`'s client (async: the running loop's) for one attempt with `seconds` left of its
    request's deadline: its timeouts capped to them and none of openai's own retries (each would wait
    its whole timeout again); None: the client as it is."""
    client = replica.aclient if asynchronous else replica.client
    if seconds is None:
        return client
    import openai
    seconds = max(seconds, 0.001)
    return client.with_options(max_retries=0, timeout=openai.Timeout(min(replica.read_timeout_s, seconds),
                                                                      connect=min(replica.connect_timeout_s, seconds)))


def _socket_of(stream) -> socket.socket | None:
    """The socket under an openai Stream's HTTP/1.1 response (None where the transport hides it)."""
    try:
        network = stream.response.extensions.get("network_stream")
        sock = network.get_extra_info("socket") if network is not None else None
    except Exception:  # noqa: BLE001 - another transport: the request then ends at its next read
        return None
    return sock if isinstance(sock, socket.socket) else None


def _shut(sock: socket.socket | None) -> None:
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass                            # already closed: nothing is reading it
