"""Decode speed on another thread than the one that loaded the model: why the engine gives the
calling thread's OpenMP workers back (kvboost_engine/request/openmp.py).

One greedy decode step of the default model (a bare transformers forward over a DynamicCache),
median of `--steps`:
  main            on the main thread (its libgomp pool exists: it loaded the model)
  thread, pool    on a second thread while the main thread's pool exists (libgomp then manages
                  more threads than CPUs and stops spin-waiting between ops)
  thread, freed   on a second thread after the main thread released its pool (building an
                  Engine does that on the thread that builds it)
and the engine's own decode step (ForwardEvent, on its scheduler thread) with the fix in place.

Run alone on a quiet machine:  python -m benchmarks.micro.threads [--steps 30]
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch
from transformers import DynamicCache

from kvboost_engine import Engine, ForwardEvent

from .._common import environment, load_default

PROMPT = "The museum's east hall holds the record of the river trade. " * 20


def hf_step_ms(model, ids, steps: int) -> float:
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        token = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1].argmax()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            token = model(token.view(1, 1), past_key_values=cache, use_cache=True).logits[0, -1].argmax()
            times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def on_thread(fn) -> float:
    out = {}
    thread = threading.Thread(target=lambda: out.update(value=fn()))
    thread.start()
    thread.join()
    return out["value"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default="benchmarks/results/threads.json")
    args = parser.parse_args(argv)
    model, tokenizer = load_default()
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    result = {"environment": environment(model)}
    result["main_ms"] = hf_step_ms(model, ids, args.steps)
    result["thread_with_main_pool_ms"] = on_thread(lambda: hf_step_ms(model, ids, args.steps))
    engine = Engine(model, tokenizer, cache_bytes=0)        # releases this (main) thread's pool
    result["thread_after_release_ms"] = on_thread(lambda: hf_step_ms(model, ids, args.steps))
    steps: list[float] = []
    on = lambda e: steps.append(e.seconds) if isinstance(e, ForwardEvent) and e.kind == "decode" else None
    with engine.instruments.subscribe(on):
        engine.generate(PROMPT, max_new_tokens=args.steps + 1, min_new_tokens=args.steps + 1)
    engine.close()
    result["engine_decode_step_ms"] = 1000 * statistics.median(steps)
    result = {k: round(v, 1) if isinstance(v, float) else v for k, v in result.items()}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps({k: v for k, v in result.items() if k != "environment"}, indent=2))


if __name__ == "__main__":
    main()
