"""Deterministic timing for tests that look at a request while it runs.

`Hold` is a LogitsConstraint that allows every token and stops the scheduler thread at the mask of
token `at` (1-based) until the test sets `release`. While it waits the request is certainly still
running, whatever the machine's speed: a test waits on `reached`, looks (memory, cancel, timeouts,
the event loop), then releases. `at=None` never holds. `advanced` counts the tokens chosen, and
`after_cancel` those chosen once the request's cancel event (`cancel_event`, set by
`hold_engine_streams`) was set: the engine promises at most one.

`hold_engine_streams` makes every `Engine.stream_chat` / `Engine.stream` call of a test carry one
Hold, for requests made through the framework classes.
"""
from __future__ import annotations

import threading

from kvboost_engine import Engine


class Hold:
    def __init__(self, at: int | None = 2, timeout: float = 60.0):
        self.at, self.timeout = at, timeout
        self.masks = self.advanced = self.after_cancel = 0
        self.reached, self.release = threading.Event(), threading.Event()
        self.cancel_event: threading.Event | None = None

    def mask(self, logits):
        self.masks += 1
        if self.masks == self.at:
            self.reached.set()
            if not self.release.wait(self.timeout):
                raise RuntimeError(f"Hold: not released within {self.timeout} s")
        return logits

    def advance(self, token: int) -> None:
        self.advanced += 1
        self.after_cancel += self.cancel_event is not None and self.cancel_event.is_set()

    def is_finished(self) -> bool:
        return False


def hold_engine_streams(monkeypatch, hold: Hold) -> None:
    """Every engine stream of this test (chat or plain) carries `hold`: one request per Hold."""
    for name in ("stream_chat", "stream"):
        original = getattr(Engine, name)

        def held(self, prompt, _original=original, **params):
            if not params.get("stop"):
                params.pop("stop", None)
            params.setdefault("constraint", hold)
            stream = _original(self, prompt, **params)
            hold.cancel_event = stream._cancel
            return stream

        monkeypatch.setattr(Engine, name, held)
