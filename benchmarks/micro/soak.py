"""Soak: thousands of mixed requests from many threads against one engine with a tiny KV pool and
a disk tier.

    python -m benchmarks.micro.soak [--requests 2000] [--threads 8] [--pool-blocks 40]
                                    [--moved-reuse blend] [--seed 0] [--every 100]
                                    [--out benchmarks/results/soak.json]

The mix, drawn per request: multi-turn chats (up to three earlier turns), streams read to the
end, streams closed after the first delta, streams cancelled from another thread, questions with
two retrieved documents as document parts (shuffled from a pool of 30), plain prompts. The
default model, fp32 on the CPU; `--pool-blocks` blocks of KV in RAM (40 blocks of 16 tokens:
640 tokens, every request fits it alone), `cache_bytes` equal to the pool, a disk tier in a
temp dir; `moved_reuse="blend"` by default, so documents are entered in the content index and its
size is measured (the engine's default, "full", keeps no content index). The engine's scheduler runs the concurrent requests batched on its one thread; a request
that fits the pool alone but not next to the running ones waits for room (up to `queue_timeout_s`,
default 300 s) instead of being refused, so a refusal of a fitting request means it starved for
that long or the waiting queue (`max_waiting`) was full.

Recorded: BudgetError refusals of requests that fit the pool alone (must be 0) and in all; any
other error; time to first token (queue wait included: p50, p95, max); the batching (forwards,
sequences per forward: mean, max); blocks still held by requests after every thread finished (must be 0); RSS, content
index entries and tree nodes every 100 requests (first, last, max: flat after warm-up); requests/s;
and whether a greedy probe after the soak answers exactly like a cache_bytes=0 engine.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import resource
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvboost_engine import BudgetError, Engine
from kvboost_engine.instrument import ForwardEvent

from .._common import environment, load_default
from ..data import qa

KINDS = ("chat", "stream", "stream_closed", "cancel", "documents", "plain")
SYSTEM = {"role": "system", "content": "You are a terse assistant. Answer in one short sentence, from the "
                                       "documents when there are any."}
PROBE = [SYSTEM, {"role": "user", "content": "In one word: what colour is the sky on a clear day?"}]
SAMPLE_EVERY = 100


@dataclass
class Soak:
    """Shared state of one soak: tickets, outcomes and samples (one lock)."""

    engine: Engine
    requests: int
    every: int = SAMPLE_EVERY
    lock: threading.Lock = field(default_factory=threading.Lock)
    issued: int = 0
    done: int = 0
    kinds: dict = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    refusals: int = 0
    refusals_fitting_pool: int = 0
    errors: list = field(default_factory=list)
    refused: list = field(default_factory=list)
    ttft_s: list = field(default_factory=list)
    forwards: int = 0
    sequences: int = 0
    most_sequences: int = 0
    samples: list = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)
    seconds: float = 0.0

    def ticket(self) -> bool:
        with self.lock:
            if self.issued >= self.requests:
                return False
            self.issued += 1
            return True

    def finished(self, kind: str, ttft_s: float | None = None) -> None:
        with self.lock:
            self.done += 1
            if ttft_s is not None:
                self.ttft_s.append(ttft_s)
            self.kinds[kind] += 1
            if self.done % self.every == 0:
                self.samples.append(sample(self.engine, self.done, time.perf_counter() - self.started))

    def forward(self, event) -> None:
        """Instruments callback (scheduler thread): count forwards and the sequences in each."""
        if isinstance(event, ForwardEvent):
            self.forwards += 1
            self.sequences += event.sequences
            self.most_sequences = max(self.most_sequences, event.sequences)


def sample(engine: Engine, done: int, elapsed: float) -> dict:
    stats = engine.stats()
    return {"requests": done, "seconds": round(elapsed, 2), "rss_bytes": rss_bytes(),
            "content_entries": stats["content_entries"], "nodes": stats["nodes"],
            "pool_blocks_used": stats["pool_blocks_used"], "evictions": stats["evictions"]}


def rss_bytes() -> int:
    """Resident memory of this process now (Linux), else its peak."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def request(rng: random.Random, docs: list[str], questions: list, history: list) -> tuple[str, list | str, int]:
    """(kind, messages or plain prompt, max_new_tokens) of one request."""
    kind = rng.choice(KINDS)
    question = rng.choice(questions).question
    max_new = rng.randint(4, 12)
    if kind == "plain":
        return kind, f"Question: {question}\nAnswer:", max_new
    if kind == "documents":
        parts = [{"type": "document", "text": d} for d in rng.sample(docs, 2)] + [{"type": "text", "text": question}]
        return kind, [SYSTEM, {"role": "user", "content": parts}], max_new
    if len(history) >= 6 or rng.random() < 0.2:
        history.clear()                                 # a new conversation
    return kind, [SYSTEM, *history, {"role": "user", "content": question}], max_new


def run_one(engine: Engine, kind: str, prompt, max_new: int, history: list) -> float | None:
    """Run one request of `kind`; returns its time to first token (None when it had none)."""
    call = (lambda: engine.stream(prompt, max_new_tokens=max_new)) if isinstance(prompt, str) else (
        lambda: engine.stream_chat(prompt, max_new_tokens=max_new))
    if kind == "stream_closed":
        stream = call()
        next(stream, None)
        stream.close()
        return None
    stream = call()
    if kind == "cancel":
        threading.Timer(0.005, stream.cancel).start()
    gen = stream.collect()
    if kind == "chat" and gen.text:
        history.extend([prompt[-1], {"role": "assistant", "content": gen.text}])
    return gen.ttft_s if gen.token_ids else None


def worker(soak: Soak, seed: int, docs: list[str], questions: list) -> None:
    rng, history = random.Random(seed), []
    while soak.ticket():
        kind, prompt, max_new = request(rng, docs, questions, history)
        ttft = None
        try:
            ttft = run_one(soak.engine, kind, prompt, max_new, history)
        except BudgetError as error:
            fits = fits_pool_alone(soak.engine, prompt, max_new)
            with soak.lock:
                soak.refusals += 1
                soak.refusals_fitting_pool += fits
                soak.refused.append(f"{kind} (fits alone: {fits}): {error}"[:300])
        except Exception as error:          # noqa: BLE001 - every failure is a finding, recorded
            with soak.lock:
                soak.errors.append(f"{kind}: {type(error).__name__}: {error}"[:300])
        soak.finished(kind, ttft)


def fits_pool_alone(engine: Engine, prompt, max_new: int) -> bool:
    """Whether the request's KV fits the pool's RAM blocks when nothing else runs."""
    stats = engine.stats()
    tokens = engine.count_tokens(prompt) + max_new
    return math.ceil(tokens / stats["pool_block_tokens"]) <= stats["pool_ram_blocks"]


def run_soak(engine: Engine, requests: int, threads: int, seed: int = 0, every: int = SAMPLE_EVERY) -> Soak:
    """Drive `requests` mixed requests from `threads` threads; returns the filled Soak."""
    docs, questions = qa.build(seed, organisations=30)
    soak = Soak(engine, requests, every)
    pool = [threading.Thread(target=worker, args=(soak, seed * 1000 + i, docs, questions), name=f"soak-{i}")
            for i in range(threads)]
    with engine.instruments.subscribe(soak.forward):
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join()
    soak.seconds = time.perf_counter() - soak.started
    return soak


def spread(samples: list[dict], key: str) -> dict:
    values = [s[key] for s in samples]
    if not values:
        return {}
    return {"first": values[0], "last": values[-1], "max": max(values), "growth": values[-1] - values[0]}


def percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    ordered = sorted(values)
    at = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"p50": round(at(0.5), 3), "p95": round(at(0.95), 3), "max": round(ordered[-1], 3)}


def summary(soak: Soak, cold: Engine) -> dict:
    """What the soak found (the figures of the module doc)."""
    memory = soak.engine.memory()
    block_bytes = soak.engine.stats()["pool_bytes"] // soak.engine.stats()["pool_blocks"]
    stats = soak.engine.stats()
    probe = soak.engine.chat(PROBE, max_new_tokens=12).token_ids == cold.chat(PROBE, max_new_tokens=12).token_ids
    return {
        "requests": soak.done, "seconds": round(soak.seconds, 1), "requests_per_s": round(soak.done / soak.seconds, 2),
        "kinds": soak.kinds, "refusals": soak.refusals, "refusals_fitting_pool": soak.refusals_fitting_pool,
        "first_refusals": soak.refused[:5], "errors": len(soak.errors), "first_errors": soak.errors[:5],
        "ttft_s": percentiles(soak.ttft_s),
        "batching": {"forwards": soak.forwards, "max_sequences": soak.most_sequences,
                     "mean_sequences": round(soak.sequences / max(soak.forwards, 1), 2)},
        "leaked_blocks": memory["in_use_bytes"] // block_bytes, "probe_equals_no_cache": probe,
        "rss_bytes": spread(soak.samples, "rss_bytes"), "content_entries": spread(soak.samples, "content_entries"),
        "nodes": spread(soak.samples, "nodes"), "samples": soak.samples,
        "cache": {k: stats[k] for k in ("hits", "misses", "evictions", "pool_blocks", "pool_ram_blocks",
                                          "pool_peak_blocks_used", "disk_hits", "disk_writes", "disk_entries")},
    }


def pool_bytes_of(model, blocks: int, block_tokens: int = 16) -> int:
    """Bytes of `blocks` KV blocks of `block_tokens` positions for `model` in fp32."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return blocks * block_tokens * 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 4


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--pool-blocks", type=int, default=40)
    parser.add_argument("--moved-reuse", default="blend", help="the engine's moved_reuse (blend indexes content)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--every", type=int, default=SAMPLE_EVERY, help="requests between samples")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "results" / "soak.json"))
    args = parser.parse_args(argv)
    model, tokenizer = load_default()
    pool_bytes = pool_bytes_of(model, args.pool_blocks)
    directory = tempfile.mkdtemp(prefix="kvboost-soak-")
    try:
        engine = Engine(model, tokenizer, kv_pool_bytes=pool_bytes, cache_bytes=pool_bytes, block_tokens=16,
                        disk_cache_dir=directory, moved_reuse=args.moved_reuse)
        soak = run_soak(engine, args.requests, args.threads, args.seed, args.every)
        result = summary(soak, Engine(model, tokenizer, cache_bytes=0))
        engine.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    scheduler = {k: getattr(engine.config, k) for k in ("max_running", "max_batch_tokens", "max_waiting",
                                                          "queue_timeout_s")}
    record = {"settings": {**vars(args), "kv_pool_bytes": pool_bytes, "disk_tier": "temp dir", **scheduler},
              "environment": environment(model), **result}
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k not in ("samples", "environment")}, indent=2))


if __name__ == "__main__":
    main()
