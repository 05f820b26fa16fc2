"""One client process of the load test against our server: `streams` concurrent streams (asyncio,
the openai package's AsyncOpenAI), each running its planned requests one after the other.

Outcomes: completed (read to the end, finish_reason seen), cancelled (stream closed after its
first deltas, as intended), disconnected (gave up waiting, as intended), refused (429 queue full or
503 draining: intended refusals), errors (anything else: must stay empty). No torch import here.
"""
from __future__ import annotations

import asyncio
import time

from dataclasses import replace

from .workload import CANCEL_AFTER_DELTAS, DISCONNECT_AFTER_S, LoadRequest, as_text, peak_rss_mib, plan

REFUSALS = (429, 503)


def new_outcome() -> dict:
    return {"completed": 0, "cancelled": 0, "disconnected": 0, "refused": 0, "errors": [], "ttft_s": [],
            "warm_ttft_s": [], "prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0, "rss_mib": 0.0}


def run_client(url: str, model: str, client: int, streams: int, requests: int, seed: int, max_tokens: int,
               text_documents: bool = False) -> dict:
    """Run one client process's streams to their end; its outcome (see `new_outcome`). `text_documents`:
    document parts sent as plain text (a server other than ours)."""
    return asyncio.run(_client(url, model, client, streams, requests, seed, max_tokens, text_documents))


async def _client(url, model, client, streams, requests, seed, max_tokens, text_documents=False) -> dict:
    import openai
    outcome = new_outcome()
    api = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=300)
    plans = [plan(seed, client, s, requests, max_tokens) for s in range(streams)]
    if text_documents:
        plans = [[replace(r, messages=as_text(r.messages)) for r in p] for p in plans]
    started = time.perf_counter()
    await asyncio.gather(*(_stream(api, model, p, outcome) for p in plans))
    outcome["seconds"] = time.perf_counter() - started
    outcome["rss_mib"] = peak_rss_mib()
    await api.close()
    return outcome


async def _stream(api, model: str, requests: list[LoadRequest], outcome: dict) -> None:
    import openai
    for request in requests:
        try:
            if request.kind == "disconnect":
                await _disconnect(api, model, request, outcome)
            else:
                await _streamed(api, model, request, outcome)
        except openai.APIStatusError as err:
            if err.status_code in REFUSALS:
                outcome["refused"] += 1
            else:
                outcome["errors"].append(f"{request.kind}: HTTP {err.status_code}: {err.message}"[:300])
        except Exception as err:  # noqa: BLE001 - every unexpected failure is recorded, none stops the run
            outcome["errors"].append(f"{request.kind}: {type(err).__name__}: {err}"[:300])


async def _streamed(api, model: str, request: LoadRequest, outcome: dict) -> None:
    """A streamed chat or RAG request read to its end, or closed after a few deltas (`cancel`)."""
    started = time.perf_counter()
    stream = await api.chat.completions.create(model=model, messages=request.messages, max_tokens=request.max_tokens,
                                               temperature=0, stream=True, stream_options={"include_usage": True})
    ttft, deltas, finished, usage, timings = None, 0, False, None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        timings = (chunk.model_extra or {}).get("timings") or timings      # llama-server's cache_n
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        if choice.delta.content:
            ttft = ttft if ttft is not None else time.perf_counter() - started
            deltas += 1
        finished = finished or choice.finish_reason is not None
        if request.kind == "cancel" and deltas >= CANCEL_AFTER_DELTAS:
            await stream.close()
            outcome["cancelled"] += 1
            return
    if not finished or usage is None:
        raise RuntimeError(f"the stream ended without {'a finish_reason' if not finished else 'its usage'}")
    _count(outcome, ttft, usage.prompt_tokens, _cached(usage, timings), usage.completion_tokens)


def _cached(usage, timings: dict | None) -> int:
    """Prompt tokens served from the server's cache: the usage's cached_tokens, else llama-server's
    timings.cache_n."""
    details = getattr(usage, "prompt_tokens_details", None)
    if details is not None and details.cached_tokens is not None:
        return details.cached_tokens
    return int((timings or {}).get("cache_n") or 0)


async def _disconnect(api, model: str, request: LoadRequest, outcome: dict) -> None:
    """A non-streamed request whose client stops waiting after DISCONNECT_AFTER_S (the server must
    cancel it); a reply that comes sooner counts as completed."""
    import openai
    try:
        reply = await api.with_options(timeout=DISCONNECT_AFTER_S).chat.completions.create(
            model=model, messages=request.messages, max_tokens=request.max_tokens, temperature=0)
    except openai.APITimeoutError:
        outcome["disconnected"] += 1
        return
    usage = getattr(reply, "usage", None)
    if usage is None:
        raise RuntimeError(f"a non-streamed reply without usage: {str(reply)[:80]!r}")
    _count(outcome, None, usage.prompt_tokens, _cached(usage, (reply.model_extra or {}).get("timings")),
           usage.completion_tokens)


def _count(outcome: dict, ttft: float | None, prompt: int, cached: int, completion: int) -> None:
    outcome["completed"] += 1
    outcome["prompt_tokens"] += prompt
    outcome["cached_tokens"] += cached or 0
    outcome["completion_tokens"] += completion
    if ttft is not None:
        outcome["ttft_s"].append(ttft)
        if cached:
            outcome["warm_ttft_s"].append(ttft)
