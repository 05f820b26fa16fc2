"""Instrumentation: a public, documented way to observe what the engine does.

Benchmarks and tracing subscribe here instead of patching engine internals:

```python
events = []
with engine.instruments.subscribe(events.append):
    engine.chat(messages)
forwards = [e for e in events if isinstance(e, ForwardEvent)]      # kind, tokens, start, seconds
first = next(e for e in events if isinstance(e, FirstTokenEvent))   # logits the first token came from
```

Callbacks run on the thread doing the work, inside the request: keep them short. An exception in
a callback is logged and does not disturb the request. With no subscriber, nothing is timed or
built.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ForwardEvent:
    """One forward pass of the model. kind: "prefill" (new prompt tokens), "repair" (new tokens
    plus recomputed moved tokens), "probe" (new tokens scoring moved ones), "decode" (one
    generated token), or "batch" (tokens of several sequences in one pass); `tokens` computed
    from position `start` (-1 for a batch); `seconds` of wall time (the forward only);
    `sequences` in the pass."""

    kind: str
    tokens: int
    start: int
    seconds: float
    sequences: int = 1


@dataclass(frozen=True, slots=True)
class FirstTokenEvent:
    """The logits [vocab] (fp32) the first generated token of a request was chosen from."""

    logits: torch.Tensor
    prompt_tokens: int


class Subscription:
    """Returned by `Instruments.subscribe`; `close()` (or leaving a `with` block) unsubscribes: no
    event is delivered to it after close() returns, but for one whose delivery had already begun."""

    def __init__(self, instruments: "Instruments", callback: Callable):
        self._instruments = instruments
        self.callback = callback
        self.open = True

    def close(self) -> None:
        self.open = False
        self._instruments._remove(self)

    def __enter__(self) -> "Subscription":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Instruments:
    """The subscribers of one engine."""

    def __init__(self):
        self._subscriptions: tuple[Subscription, ...] = ()     # one per subscribe(), the same callback or not
        self._lock = threading.Lock()

    def subscribe(self, callback: Callable[[object], None]) -> Subscription:
        """Call `callback(event)` for every event from now on."""
        if not callable(callback):
            raise TypeError(f"callback must be callable, got {type(callback).__name__}")
        subscription = Subscription(self, callback)
        with self._lock:
            self._subscriptions = (*self._subscriptions, subscription)
        return subscription

    def _remove(self, subscription: Subscription) -> None:
        """End this one subscription (another of the same callback goes on)."""
        with self._lock:
            self._subscriptions = tuple(s for s in self._subscriptions if s is not subscription)

    @property
    def active(self) -> bool:
        return bool(self._subscriptions)

    def emit(self, event) -> None:
        for subscription in self._subscriptions:
            if not subscription.open:       # closed while an earlier callback of this event ran
                continue
            try:
                subscription.callback(event)
            except Exception:  # noqa: BLE001 - an observer must never break a request
                log.exception("kvboost instrumentation callback %r failed", subscription.callback)
