"""Chaos soak: the soak's mixed requests from many threads, with faults injected into the engine's
scheduler and a remote replica that hangs and drops at random.

    python -m benchmarks.micro.chaos [--requests 2000] [--threads 8] [--fault-rate 0.01]
                                     [--remote-share 0.25] [--replica-fault-rate 0.2] [--seed 0]
                                     [--out benchmarks/results/chaos.json]

Local requests (the soak's kinds: chats, streams read / closed / cancelled, documents, plain prompts)
go to one default engine (fp32, 40-block KV pool, disk tier) while every scheduler seam raises with
probability `--fault-rate` per call: admission (the continues-a-prefill check, assemble), prefill
(settling a prompt's last chunk), decode (first token, each later token), the KV store (at the first
token and at the finish) and the end of the text (at a finish or a cancel). The injection
(`kvboost_tools.scheduler_faults`) wraps those functions for the run: the only patching, and it
changes no figure but the outcomes.
Remote requests (`--remote-share` of them) go through `ChatKVBoost(endpoint=[flaky, good])` to two
fake OpenAI-compatible servers on 127.0.0.1 (`kvboost_tools.fake_openai`): the flaky one hangs, drops
the connection (before or mid-stream) or sends a malformed chunk on `--replica-fault-rate` of its
requests, with short timeouts, so each call must fail over, or raise a clear error, in bounded time.

Every request ends in one of: a result; an injected fault delivered as an error (the fault itself,
or the scheduler's "internal error" naming it); a clear remote error; a refusal (BudgetError). Also
recorded: hangs (a request past its timeout_s: RequestTimeoutError; a remote call past its bound),
lost requests (tickets issued without an outcome once the threads are joined), other errors (must be
0), blocks still held by requests at the end (must be 0), RSS every `--every` requests (flat after
warm-up), and a greedy probe after the soak against a cache_bytes=0 engine.
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import threading
import time
from pathlib import Path

from kvboost_engine import BudgetError, Engine, KVBoostError, RequestTimeoutError
from kvboost_tools.scheduler_faults import InjectedFault, SchedulerFaults

from .._common import environment, load_default
from ..data import qa
from .soak import PROBE, percentiles, pool_bytes_of, request, rss_bytes, spread

REQUEST_TIMEOUT_S = 120.0        # a local request past this is a hang (they take well under a second alone)
REMOTE_BOUND_S = 10.0            # a remote call past this is a hang (timeouts below are 1-2 s per replica)
class Outcomes:
    """Tickets and what each request ended as (one lock)."""

    def __init__(self, requests: int, every: int):
        self.requests, self.every, self.lock = requests, every, threading.Lock()
        self.issued = self.done = 0
        self.counts: dict[str, int] = {}
        self.examples: dict[str, list] = {}
        self.ttft_s: list = []
        self.samples: list = []
        self.started = time.perf_counter()

    def ticket(self) -> bool:
        with self.lock:
            if self.issued >= self.requests:
                return False
            self.issued += 1
            return True

    def record(self, outcome: str, detail: str = "", ttft: float | None = None) -> None:
        with self.lock:
            self.done += 1
            self.counts[outcome] = self.counts.get(outcome, 0) + 1
            if detail and len(self.examples.setdefault(outcome, [])) < 3:
                self.examples[outcome].append(detail[:300])
            if ttft is not None:
                self.ttft_s.append(ttft)
            if self.done % self.every == 0:
                self.samples.append({"requests": self.done, "rss_bytes": rss_bytes(),
                                     "seconds": round(time.perf_counter() - self.started, 1)})


def local_call(engine: Engine, kind: str, prompt, max_new: int) -> float | None:
    """One local request of `kind` (the soak's kinds); its TTFT, or None."""
    start = (lambda: engine.stream(prompt, max_new_tokens=max_new, timeout_s=REQUEST_TIMEOUT_S)) \
        if isinstance(prompt, str) else (lambda: engine.stream_chat(prompt, max_new_tokens=max_new,
                                                                    timeout_s=REQUEST_TIMEOUT_S))
    stream = start()
    if kind == "stream_closed":
        next(stream, None)
        stream.close()
        return None
    if kind == "cancel":
        threading.Timer(0.005, stream.cancel).start()
    gen = stream.collect()
    return gen.ttft_s if gen.token_ids else None


def classify(err: BaseException) -> str:
    if isinstance(err, RequestTimeoutError):
        return "hang"
    if isinstance(err, InjectedFault) or (isinstance(err, KVBoostError) and "InjectedFault" in str(err)):
        return "injected_error"
    if isinstance(err, BudgetError):
        return "refused"
    return "other_error"


def local_worker(engine: Engine, out: Outcomes, seed: int, docs, questions, remote) -> None:
    rng, history = random.Random(seed), []
    while out.ticket():
        if remote is not None and rng.random() < remote.share:
            remote.call(out, rng)
            continue
        kind, prompt, max_new = request(rng, docs, questions, history)
        try:
            ttft = local_call(engine, kind, prompt, max_new)
        except Exception as err:  # noqa: BLE001 - every ending is counted
            out.record(classify(err), f"{kind}: {type(err).__name__}: {err}")
            continue
        out.record("ok", ttft=ttft)


class RemoteChaos:
    """ChatKVBoost(endpoint=[flaky, good]) over two fake servers; the flaky one faults at random."""

    def __init__(self, share: float, fault_rate: float, seed: int):
        from kvboost_tools.fake_faults import Chaos
        from kvboost_tools.fake_openai import FakeServer
        self.share = share
        self.good = FakeServer(reply="The answer is 42. Done.")
        rates = {"hang": fault_rate / 3, "drop": fault_rate / 3, "malformed": fault_rate / 3}
        self.flaky = FakeServer(reply="The answer is 42. Done.",
                                fault=Chaos(rates, seed=seed, after_chunks=(0, 0, 2)))
        self.durations: list[float] = []

    def __enter__(self):
        from kvboost_integrations.langchain import ChatKVBoost
        self.good.__enter__()
        self.flaky.__enter__()
        self.llm = ChatKVBoost(endpoint=[self.flaky.url, self.good.url], max_tokens=16,
                               engine_kwargs={"connect_timeout_s": 1.0, "read_timeout_s": 1.0})
        return self

    def __exit__(self, *exc):
        self.flaky.__exit__(*exc)
        self.good.__exit__(*exc)

    def call(self, out: Outcomes, rng: random.Random) -> None:
        started = time.perf_counter()
        try:
            reply = self.llm.invoke(f"Question {rng.randint(0, 99)}: what is the answer?")
            outcome, detail = ("remote_ok", "") if reply.content else ("other_error", "empty reply")
        except KVBoostError as err:
            outcome, detail = "remote_error", f"{type(err).__name__}: {err}"
        except Exception as err:  # noqa: BLE001
            outcome, detail = "other_error", f"{type(err).__name__}: {err}"
        took = time.perf_counter() - started
        self.durations.append(took)
        out.record("hang" if took > REMOTE_BOUND_S else outcome, detail)

    def summary(self) -> dict:
        return {"flaky_faults": dict(self.flaky.fault.drawn), "flaky_requests": len(self.flaky.requests),
                "good_requests": len(self.good.requests), "call_s": percentiles(self.durations)}


def run_chaos(engine: Engine, requests: int, threads: int, *, fault_rate: float, remote_share: float,
              replica_fault_rate: float, seed: int = 0, every: int = 100) -> dict:
    """Drive the chaos soak; returns what it found (the figures of the module doc)."""
    docs, questions = qa.build(seed, organisations=30)
    out = Outcomes(requests, every)
    remote = RemoteChaos(remote_share, replica_fault_rate, seed) if remote_share > 0 else None
    faults = SchedulerFaults(fault_rate, seed)
    with faults, (remote or _Nothing()):
        pool = [threading.Thread(target=local_worker, args=(engine, out, seed * 1000 + i, docs, questions, remote),
                                 name=f"chaos-{i}", daemon=True) for i in range(threads)]
        for thread in pool:
            thread.start()
        deadline = time.monotonic() + requests * REQUEST_TIMEOUT_S
        for thread in pool:
            thread.join(max(0.0, deadline - time.monotonic()))
    block_bytes = engine.stats()["pool_bytes"] // engine.stats()["pool_blocks"]
    return {"requests": requests, "seconds": round(time.perf_counter() - out.started, 1),
            "outcomes": out.counts, "examples": out.examples, "lost": out.issued - out.done,
            "hangs": out.counts.get("hang", 0), "other_errors": out.counts.get("other_error", 0),
            "injected": faults.injected, "leaked_blocks": engine.memory()["in_use_bytes"] // block_bytes,
            "ttft_s": percentiles(out.ttft_s), "rss_bytes": spread(out.samples, "rss_bytes"),
            "samples": out.samples, "remote": remote.summary() if remote else None}


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--fault-rate", type=float, default=0.01, help="chance that a scheduler seam raises per call")
    parser.add_argument("--remote-share", type=float, default=0.25, help="share of requests sent to the remote pair")
    parser.add_argument("--replica-fault-rate", type=float, default=0.2, help="share of the flaky replica's faults")
    parser.add_argument("--pool-blocks", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--every", type=int, default=100, help="requests between RSS samples")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "results" / "chaos.json"))
    args = parser.parse_args(argv)
    model, tokenizer = load_default()
    pool_bytes = pool_bytes_of(model, args.pool_blocks)
    directory = tempfile.mkdtemp(prefix="kvboost-chaos-")
    try:
        engine = Engine(model, tokenizer, kv_pool_bytes=pool_bytes, cache_bytes=pool_bytes, block_tokens=16,
                        disk_cache_dir=directory)
        found = run_chaos(engine, args.requests, args.threads, fault_rate=args.fault_rate,
                          remote_share=args.remote_share, replica_fault_rate=args.replica_fault_rate,
                          seed=args.seed, every=args.every)
        cold = Engine(model, tokenizer, cache_bytes=0)
        found["probe_equals_no_cache"] = (engine.chat(PROBE, max_new_tokens=12).token_ids
                                          == cold.chat(PROBE, max_new_tokens=12).token_ids)
        engine.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    record = {"settings": {**vars(args), "kv_pool_bytes": pool_bytes, "request_timeout_s": REQUEST_TIMEOUT_S,
                           "remote_bound_s": REMOTE_BOUND_S}, "environment": environment(model), **found}
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k not in ("samples", "environment")}, indent=2))


if __name__ == "__main__":
    main()
