"""Running requests through LangChain chat models and measuring what the servers did.

Requests run one at a time, systems interleaved request by request (a slow stretch of a busy
machine hits both alike). Per request: TTFT (call to the first non-empty chunk, through
`.stream()` for every system), prompt and cached tokens from the usage each system reports,
and the servers' own prefix-cache counters (/metrics) read before and after it, so each
request's server hits are its own even though the systems share the servers.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

from kvboost_integrations.remote import Replica

from .workloads import Request


class Counters:
    """The prefix-cache counters of a set of servers, read around each request."""

    def __init__(self, urls: Sequence[str]):
        self.replicas = [Replica(url) for url in urls]

    def read(self) -> list:
        return [replica.prefix_counters() for replica in self.replicas]

    @staticmethod
    def delta(before: list, after: list) -> dict | None:
        pairs = [(b, a) for b, a in zip(before, after) if b is not None and a is not None]
        if not pairs:
            return None
        return {"queries": int(sum((a - b).queries for b, a in pairs)), "hits": int(sum((a - b).hits for b, a in pairs))}


def one_request(llm, messages, counters: Counters, request: Request) -> dict:
    """Stream one request; its TTFT, usage, server counters and (rag) whether the answer is in it."""
    before = counters.read()
    started = time.perf_counter()
    first, total = None, None
    for chunk in llm.stream(messages):
        if first is None and chunk.content:
            first = time.perf_counter() - started
        total = chunk if total is None else total + chunk
    elapsed = time.perf_counter() - started
    server = Counters.delta(before, counters.read())
    usage = total.usage_metadata or {}
    details = usage.get("input_token_details") or {}
    text = total.content if isinstance(total.content, str) else str(total.content)
    row = {"label": request.label, "ttft_s": first if first is not None else elapsed, "total_s": elapsed,
           "prompt_tokens": usage.get("input_tokens", 0), "cached_tokens": details.get("cache_read") or 0,
           "server": server, "replica": total.response_metadata.get("replica"), "reply": text[:80]}
    if request.answer:
        row["correct"] = request.answer.lower() in text.lower()
    return row


def run_interleaved(systems: dict, requests: dict[str, list[Request]], counters: Counters) -> dict[str, list]:
    """`systems`: name -> (llm, "ours" or "peer"); `requests`: name -> that system's requests
    (same workload, its own tag). Request i of every system runs before request i + 1 of any."""
    rows = {name: [] for name in systems}
    for index in range(len(next(iter(requests.values())))):
        for name, (llm, side) in systems.items():
            request = requests[name][index]
            rows[name].append(one_request(llm, request.ours if side == "ours" else request.peer, counters, request))
    return rows


def summary(rows: list[dict]) -> dict:
    """Hit rates (client-reported and server-counted), TTFT medians, answers found."""
    prompt = sum(r["prompt_tokens"] for r in rows)
    cached = sum(r["cached_tokens"] for r in rows)
    servers = [r["server"] for r in rows if r["server"]]
    ttft = [r["ttft_s"] for r in rows]
    later = [r["ttft_s"] for r in rows[1:]]
    out = {"requests": len(rows), "prompt_tokens": prompt, "cached_tokens": cached,
           "hit_rate": cached / prompt if prompt else None,
           "ttft_median_s": statistics.median(ttft), "ttft_mean_s": statistics.fmean(ttft),
           "ttft_median_after_first_s": statistics.median(later) if later else None}
    if servers:
        queries, hits = sum(s["queries"] for s in servers), sum(s["hits"] for s in servers)
        out["server"] = {"queries": queries, "hits": hits, "hit_rate": hits / queries if queries else None}
    replicas = {r["replica"] for r in rows if r["replica"]}
    if replicas:
        out["replicas_used"] = len(replicas)
    if any("correct" in r for r in rows):
        out["answers_found"] = sum(r.get("correct", False) for r in rows)
    return out
