"""Server prefix-cache telemetry: the /metrics counters, per-request figures, a small report.

Two sources, both reported:
- per request, the server's `usage.prompt_tokens_details.cached_tokens` (vLLM with
  `--enable-prompt-tokens-details`, llama-server always): prompt tokens whose KV the server reused;
- per replica, its Prometheus counters on /metrics: vLLM's `vllm:prefix_cache_queries_total` and
  `vllm:prefix_cache_hits_total` (tokens), llama-server's `llamacpp:prompt_tokens_total`
  (computed) and `llamacpp:prompt_tokens_cached_total` (reused), as deltas since this client's
  first request to the replica.
"""
from __future__ import annotations

import math
import re
import threading
from dataclasses import dataclass

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")

# server kind -> (queries counter, hits counter); llama.cpp counts computed and cached separately
VLLM_COUNTERS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
VLLM_LEGACY = ("vllm:gpu_prefix_cache_queries_total", "vllm:gpu_prefix_cache_hits_total")
LLAMA_COUNTERS = ("llamacpp:prompt_tokens_total", "llamacpp:prompt_tokens_cached_total")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {metric name: value summed over its label sets}."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match:
            try:
                value = float(match.group(3))
            except ValueError:
                continue
            if not math.isnan(value):
                values[match.group(1)] = values.get(match.group(1), 0.0) + value
    return values


@dataclass(frozen=True)
class PrefixCounters:
    """A replica's prefix-cache counters: prompt tokens looked up, and found cached."""

    queries: float = 0.0
    hits: float = 0.0

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.queries if self.queries else None

    def __sub__(self, other: "PrefixCounters") -> "PrefixCounters":
        return PrefixCounters(self.queries - other.queries, self.hits - other.hits)

    def as_dict(self) -> dict:
        return {"queries": int(self.queries), "hits": int(self.hits), "hit_rate": self.hit_rate}


def prefix_counters(metrics: dict[str, float]) -> PrefixCounters | None:
    """The prefix-cache counters in a parsed /metrics page, or None if it has none we know."""
    for queries, hits in (VLLM_COUNTERS, VLLM_LEGACY):
        if queries in metrics and hits in metrics:
            return PrefixCounters(metrics[queries], metrics[hits])
    computed, cached = LLAMA_COUNTERS
    if computed in metrics and cached in metrics:
        return PrefixCounters(metrics[computed] + metrics[cached], metrics[cached])
    return None


class CacheReport:
    """What this client saw per replica (requests, prompt and cached tokens, TTFT) plus the
    replicas' own counters since the first request this client sent them (thread-safe)."""

    def __init__(self, names: list[str]):
        self._lock = threading.Lock()
        self._client = {name: {"requests": 0, "failures": 0, "prompt_tokens": 0, "cached_tokens": 0,
                               "ttft_s": 0.0} for name in names}
        self._baseline: dict[str, PrefixCounters | None] = {}

    def needs_baseline(self, name: str) -> bool:
        with self._lock:
            return name not in self._baseline

    def set_baseline(self, name: str, counters: PrefixCounters | None) -> None:
        with self._lock:
            self._baseline.setdefault(name, counters)

    def add(self, name: str, prompt_tokens: int, cached_tokens: int | None, ttft_s: float) -> None:
        with self._lock:
            entry = self._client[name]
            entry["requests"] += 1
            entry["prompt_tokens"] += prompt_tokens
            entry["cached_tokens"] += cached_tokens or 0
            entry["ttft_s"] += ttft_s

    def failed(self, name: str) -> None:
        with self._lock:
            self._client[name]["failures"] += 1

    def snapshot(self, current: dict[str, PrefixCounters | None]) -> dict:
        """The report: per replica and in total. `current`: each replica's counters now."""
        with self._lock:
            replicas = {}
            for name, entry in self._client.items():
                row = {**entry, "hit_rate": _ratio(entry["cached_tokens"], entry["prompt_tokens"]),
                       "mean_ttft_s": _ratio(entry["ttft_s"], entry["requests"])}
                del row["ttft_s"]
                base, now = self._baseline.get(name), current.get(name)
                row["server"] = (now - base).as_dict() if base is not None and now is not None else None
                replicas[name] = row
        total = {key: sum(r[key] for r in replicas.values())
                 for key in ("requests", "failures", "prompt_tokens", "cached_tokens")}
        total["hit_rate"] = _ratio(total["cached_tokens"], total["prompt_tokens"])
        servers = [r["server"] for r in replicas.values() if r["server"]]
        if servers:
            server = PrefixCounters(sum(s["queries"] for s in servers), sum(s["hits"] for s in servers))
            total["server"] = server.as_dict()
        return {"replicas": replicas, "total": total}


def format_report(report: dict) -> str:
    """The report as a small text table."""
    lines = [f"{'replica':<32} {'requests':>8} {'prompt':>8} {'cached':>8} {'hit rate':>8} {'server hit':>10}"]
    rows = list(report["replicas"].items()) + [("total", report["total"])]
    for name, row in rows:
        server = row.get("server") or {}
        lines.append(f"{name:<32} {row['requests']:>8} {row['prompt_tokens']:>8} {row['cached_tokens']:>8} "
                     f"{_percent(row['hit_rate']):>8} {_percent(server.get('hit_rate')):>10}")
    return "\n".join(lines)


def _ratio(part: float, whole: float) -> float | None:
    return part / whole if whole else None


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"
