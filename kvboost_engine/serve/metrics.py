"""The server's counters, in Prometheus' text format (GET /metrics).

kvboost_requests_total{route,status}, kvboost_prompt_tokens_total, kvboost_generation_tokens_total,
kvboost_cached_tokens_total{kind="exact"|"moved"} (prompt tokens whose KV came from the cache, by
kind of reuse), kvboost_requests_running (admitted and not finished), kvboost_requests_waiting
(sent to the engine, no first token yet: the queue depth), kvboost_time_to_first_token_seconds
(histogram), and the engine's KV bytes by holder (kvboost_kv_bytes{holder}).
"""
from __future__ import annotations

import threading
from collections import Counter

from ..request.generation import Generation

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    """Thread-safe counters of one server."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests: Counter = Counter()          # (route, status) -> count
        self.tokens: Counter = Counter()            # prompt, generation, cached_exact, cached_moved
        self.running = 0
        self.waiting = 0
        self._ttft = [0] * len(TTFT_BUCKETS)
        self._ttft_sum = 0.0
        self._ttft_count = 0

    def answered(self, route: str, status: int) -> None:
        with self._lock:
            self.requests[(route, status)] += 1

    def started(self) -> None:
        """A request went to the engine (it waits for its first token)."""
        with self._lock:
            self.running += 1
            self.waiting += 1

    def first_event(self) -> None:
        """The request's first event came (a token, its end or its error): it no longer waits."""
        with self._lock:
            self.waiting -= 1

    def finished(self, gen: Generation | None) -> None:
        """The request ended (`gen` None: with an error); its tokens and TTFT are counted."""
        with self._lock:
            self.running -= 1
            if gen is None:
                return
            self.tokens.update(prompt=gen.prompt_tokens, generation=gen.completion_tokens,
                               cached_exact=gen.reused_exact, cached_moved=gen.reused_moved)
            if gen.completion_tokens:
                self._ttft_sum += gen.ttft_s
                self._ttft_count += 1
                for i, bound in enumerate(TTFT_BUCKETS):
                    if gen.ttft_s <= bound:
                        self._ttft[i] += 1

    def render(self, kv_bytes: dict[str, int] | None = None) -> str:
        """Every metric as Prometheus text (version 0.0.4)."""
        with self._lock:
            lines = _family("kvboost_requests_total", "counter", "HTTP requests answered, by route and status")
            lines += [f'kvboost_requests_total{{route="{route}",status="{status}"}} {n}'
                      for (route, status), n in sorted(self.requests.items())]
            for name, key, text in (("prompt_tokens", "prompt", "prompt tokens of finished requests"),
                                    ("generation_tokens", "generation", "tokens generated")):
                lines += _family(f"kvboost_{name}_total", "counter", text)
                lines.append(f"kvboost_{name}_total {self.tokens[key]}")
            lines += _family("kvboost_cached_tokens_total", "counter",
                             "prompt tokens whose KV came from the cache, by kind of reuse")
            lines += [f'kvboost_cached_tokens_total{{kind="{kind}"}} {self.tokens["cached_" + kind]}'
                      for kind in ("exact", "moved")]
            lines += _family("kvboost_requests_running", "gauge", "requests sent to the engine and not finished")
            lines.append(f"kvboost_requests_running {self.running}")
            lines += _family("kvboost_requests_waiting", "gauge", "requests waiting for their first token")
            lines.append(f"kvboost_requests_waiting {self.waiting}")
            lines += self._ttft_lines()
        if kv_bytes:
            lines += _family("kvboost_kv_bytes", "gauge", "bytes of KV memory, by holder")
            lines += [f'kvboost_kv_bytes{{holder="{holder}"}} {value}' for holder, value in sorted(kv_bytes.items())]
        return "\n".join(lines) + "\n"

    def _ttft_lines(self) -> list[str]:
        name = "kvboost_time_to_first_token_seconds"
        lines = _family(name, "histogram", "seconds from the request to its first generated token")
        for bound, count in zip(TTFT_BUCKETS, self._ttft):
            lines.append(f'{name}_bucket{{le="{bound}"}} {count}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {self._ttft_count}')
        lines.append(f"{name}_sum {self._ttft_sum}")
        lines.append(f"{name}_count {self._ttft_count}")
        return lines


def _family(name: str, kind: str, text: str) -> list[str]:
    return [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]


def kv_bytes(memory: dict) -> dict[str, int]:
    """The engine's `memory()` as holder -> bytes (the `_bytes` entries, suffix dropped)."""
    return {key[:-6]: int(value) for key, value in memory.items()
            if key.endswith("_bytes") and isinstance(value, (int, float))}
