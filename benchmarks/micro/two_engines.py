"""Two engines in one process decoding at once (an embedding model beside a chat model, two agents,
a notebook beside a service): each engine's decode speed together, as a ratio of its speed alone.

Two copies of the default model are loaded (as two models in one app would be), each behind its own
Engine (cache off, the default thread count: each engine's OpenMP team is as wide as torch's). Per
repeat: engine A alone, engine B alone, then A and B at once, each from its own thread, started
together; every run greedily decodes `--tokens` tokens after its own short prompt. Decode speed is
(tokens - 1) / (total - TTFT) of each reply; medians over `--repeats`, after one warm-up each.
Ratio: the median over repeats of together / alone (each repeat against its own alone runs).
Both with the native decode step (the default) and with `native_decode=False` (PyTorch ops).
The replies together are checked against the replies alone (greedy: they must be the same).

Run alone on a quiet machine:  python -m benchmarks.micro.two_engines [--quick] [--out ...]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import threading

from kvboost_engine import Engine

from .._common import environment, load_default, save_result

PROMPTS = ("Write a short story about a lighthouse keeper.", "Explain how a bicycle gear works.")


def decode_tok_s(generation) -> float:
    return (generation.completion_tokens - 1) / max(generation.total_s - generation.ttft_s, 1e-9)


def run(engine: Engine, prompt: str, tokens: int):
    return engine.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens)


def together(engines: list[Engine], tokens: int) -> list:
    """Each engine's generation when all run at once, one thread each, released together."""
    out: list = [None] * len(engines)
    start = threading.Barrier(len(engines))

    def one(i: int) -> None:
        start.wait()
        out[i] = run(engines[i], PROMPTS[i], tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(engines))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def measure(engines: list[Engine], tokens: int, repeats: int) -> dict:
    """Alone and together tok/s per engine (medians), the median of each repeat's ratio (together
    over the alone runs just before it: steadier on a shared machine), and whether replies matched."""
    for i, engine in enumerate(engines):
        run(engine, PROMPTS[i], tokens)                            # warm-up
    alone, both, ratios = ([[] for _ in engines] for _ in range(3))
    same = True
    for _ in range(repeats):
        solo = [run(engine, PROMPTS[i], tokens) for i, engine in enumerate(engines)]
        pair = together(engines, tokens)
        for i in range(len(engines)):
            alone[i].append(decode_tok_s(solo[i]))
            both[i].append(decode_tok_s(pair[i]))
            ratios[i].append(both[i][-1] / alone[i][-1])
            same = same and solo[i].token_ids == pair[i].token_ids
    rows = [{"alone_tok_s": round(statistics.median(alone[i]), 1),
             "together_tok_s": round(statistics.median(both[i]), 1),
             "ratio": round(statistics.median(ratios[i]), 2)} for i in range(len(engines))]
    return {"engines": rows, "replies_same_as_alone": same,
            "native_decode": [e.stats()["native_decode"] for e in engines]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="8 tokens, 1 repeat (a smoke test)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    tokens, repeats = (8, 1) if args.quick else (args.tokens, args.repeats)
    models = [load_default(), load_default()]
    result = {"environment": environment(models[0][0]), "tokens": tokens, "repeats": repeats}
    for name, native in (("native", None), ("pytorch", False)):
        engines = [Engine(m, tok, cache_bytes=0, native_decode=native) for m, tok in models]
        try:
            result[name] = measure(engines, tokens, repeats)
        finally:
            for engine in engines:
                engine.close()
        print(name, json.dumps(result[name]), flush=True)
    result["load_average_after"] = os.getloadavg()[0]          # others' work on the machine skews both
    path = save_result(result, args.out, "two_engines")
    print(f"saved {path}")


if __name__ == "__main__":
    main()
