"""The load test's workload on embedded engines: each client process loads its own Engine (the
default model, fp32) and runs its streams on threads against it, with no server in between.

The same requests as against the server (workload.plan); a cancelled stream is cancelled after
two deltas, a disconnecting client is a request with `timeout_s=0.3`. The processes load their
engines, then start together (a barrier), so the timed window holds the workload only.
"""
from __future__ import annotations

import threading
import time

from .clients import new_outcome
from .workload import CANCEL_AFTER_DELTAS, DISCONNECT_AFTER_S, LoadRequest, peak_rss_mib, plan


def run_embedded_client(barrier, results, torch_threads: int, client: int, streams: int, requests: int, seed: int,
                        max_tokens: int) -> None:
    """One process: load an engine, wait for the others, run the streams; put the outcome on `results`."""
    import torch

    from kvboost_engine import Engine
    torch.set_num_threads(torch_threads)
    outcome = new_outcome()
    try:
        engine = Engine.from_pretrained(dtype="float32")
    except Exception as err:  # noqa: BLE001 - reported, not raised in a child
        outcome["errors"].append(f"load: {type(err).__name__}: {err}"[:300])
        barrier.wait()
        results.put(outcome)
        return
    lock = threading.Lock()
    plans = [plan(seed, client, s, requests, max_tokens) for s in range(streams)]
    barrier.wait()
    started = time.time()
    threads = [threading.Thread(target=_stream, args=(engine, p, outcome, lock)) for p in plans]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    outcome["started"], outcome["ended"] = started, time.time()
    outcome["rss_mib"] = peak_rss_mib()
    engine.close()
    results.put(outcome)


def _stream(engine, requests: list[LoadRequest], outcome: dict, lock: threading.Lock) -> None:
    from kvboost_engine import QueueFullError, RequestTimeoutError
    for request in requests:
        try:
            result = _one(engine, request)
        except RequestTimeoutError:
            result = ("disconnected", None)
        except QueueFullError:
            result = ("refused", None)
        except Exception as err:  # noqa: BLE001 - every failure is recorded, none stops the run
            result = ("error", f"{request.kind}: {type(err).__name__}: {err}"[:300])
        with lock:
            _record(outcome, *result)


def _one(engine, request: LoadRequest) -> tuple[str, object]:
    """("completed", (ttft, generation)), ("cancelled", None) or ("disconnected", None)."""
    timeout = DISCONNECT_AFTER_S if request.kind == "disconnect" else None
    started = time.perf_counter()
    stream = engine.stream_chat(request.messages, max_new_tokens=request.max_tokens, temperature=0.0,
                                timeout_s=timeout)
    ttft, deltas = None, 0
    for delta in stream:
        if delta:
            ttft = ttft if ttft is not None else time.perf_counter() - started
            deltas += 1
        if request.kind == "cancel" and deltas >= CANCEL_AFTER_DELTAS:
            stream.cancel()
            return "cancelled", None
    return "completed", (ttft if request.kind != "disconnect" else None, stream.generation)


def _record(outcome: dict, what: str, detail) -> None:
    if what == "error":
        outcome["errors"].append(detail)
    elif what != "completed":
        outcome[what] += 1
    else:
        ttft, gen = detail
        outcome["completed"] += 1
        outcome["prompt_tokens"] += gen.prompt_tokens
        outcome["cached_tokens"] += gen.reused_tokens
        outcome["completion_tokens"] += gen.completion_tokens
        if ttft is not None:
            outcome["ttft_s"].append(ttft)
            if gen.reused_tokens:
                outcome["warm_ttft_s"].append(ttft)
