"""Faults for the fake OpenAI-compatible server (`kvboost_tools.fake_openai`): what a broken
replica does, one fault at a time (`Fault`) or drawn per request with a seeded RNG (`Chaos`).

    server.fault = Fault("drop", after_chunks=3)          # every completion: 3 text chunks, then the socket closes
    server.fault = Chaos({"hang": 0.05, "drop": 0.05}, seed=7)   # per request, reproducible
    server.fault = None                                   # healthy again (switch at any time)
"""
from __future__ import annotations

import random
import threading
from dataclasses import dataclass

# What each mode does to a request it applies to:
#   hang       accept, then never answer (until the server stops): before the status line, or mid-stream
#   drop       close the connection: before any response, or mid-stream (an incomplete chunked body)
#   non_json   a 200 whose body is not JSON (an HTML error page)
#   malformed  a server-sent event whose data is not valid JSON
#   no_finish  a clean end of stream (data: [DONE]) without a chunk carrying finish_reason
#   error      an HTTP error status (`status`, 503 by default)
#   slow       the whole reply, `delay_s` between chunks
#   keepalive  mid-stream, SSE comments (": keep-alive") every `delay_s` and nothing else (until the
#              server stops): bytes keep coming, so no read times out, but no chunk ever does
MODES = ("hang", "drop", "non_json", "malformed", "no_finish", "error", "slow", "keepalive")
COMPLETIONS = ("/v1/chat/completions", "/v1/completions")


@dataclass(frozen=True)
class Fault:
    """One way to fail. `after_chunks`: text chunks sent before a mid-stream fault (hang, drop,
    malformed); 0 faults before the first one. `paths`: the request paths it applies to
    (completions by default; "*" for every path, /metrics and /v1/models included)."""

    mode: str
    after_chunks: int = 0
    paths: tuple[str, ...] | str = COMPLETIONS
    status: int = 503
    delay_s: float = 0.2

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"fault mode must be one of {MODES}, got {self.mode!r}")
        if self.after_chunks < 0 or self.delay_s < 0:
            raise ValueError("after_chunks and delay_s must be >= 0")

    def applies_to(self, path: str) -> bool:
        return self.paths == "*" or path in self.paths

    def pick(self, path: str) -> "Fault | None":
        """This fault for a request to `path`, or None if it does not apply there."""
        return self if self.applies_to(path) else None


class Chaos:
    """A fault drawn per completion request: `rates` maps a mode to its probability (the rest
    of the requests are served normally); `after_chunks` is drawn from the given choices. The
    draws come from `random.Random(seed)`, so a run's sequence of faults is reproducible (in
    request arrival order). `drawn` counts the faults injected so far, by mode."""

    def __init__(self, rates: dict[str, float], *, seed: int = 0, after_chunks: tuple[int, ...] = (0,),
                 paths: tuple[str, ...] | str = COMPLETIONS, status: int = 503, delay_s: float = 0.2):
        if sum(rates.values()) > 1.0 or any(rate < 0 for rate in rates.values()):
            raise ValueError(f"fault rates must be >= 0 and sum to at most 1, got {rates}")
        self.faults = {mode: [Fault(mode, after, paths, status, delay_s) for after in after_chunks] for mode in rates}
        self.rates = dict(rates)
        self.paths = paths
        self.drawn = dict.fromkeys(rates, 0)
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def pick(self, path: str) -> Fault | None:
        if not (self.paths == "*" or path in self.paths):
            return None
        with self._lock:
            draw = self._rng.random()
            for mode, rate in self.rates.items():
                if draw < rate:
                    self.drawn[mode] += 1
                    return self._rng.choice(self.faults[mode])
                draw -= rate
        return None
