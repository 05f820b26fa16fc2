"""The native step over M rows (#29): one decode step of M sequences at 1, 4, 8, 16 and 64 rows, for
the default model in fp32 and with weights="int4", straight through native/decoder.py (no engine,
no scheduler): what a batched step costs against a step of one row.

Per weights (--weights, default fp32,int4):
  prefill_tok_s   a prompt of --context tokens prefilled natively (chunks of PREFILL_ROWS rows), tok/s
  shared          M rows over one sequence's KV at its end (every row reads the same --context keys,
                  as sequences over one cached system prompt do; one token, as they all write the same
                  slot): ms per step, median over --repeats rounds that visit every M in turn (the
                  machine's drift falls on every M alike)
  unshared        M rows, each over its own copy of that KV (no key read twice), M <= 16
  speedup         M x step(1) / step(M): tokens per unit of time at M rows against one row
Run alone on a quiet machine (about 2 minutes on 2 cores), no OMP_WAIT_POLICY:
  python -m benchmarks.micro.native_rows [--weights fp32,int4] [--context 1000]
      [--rows 1,4,8,16,64] [--repeats 15] [--out benchmarks/results/native_rows.json]
Smoke: python -m benchmarks.micro.native_rows --smoke
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from kvboost_engine import Engine
from kvboost_engine.kv.contiguous import SequenceKV
from kvboost_engine.model.arch import ModelAdapter
from kvboost_engine.native.decoder import native_decoder

from .._common import environment
from .batching_report import load_weights

UNSHARED_MAX = 16


def load(weights: str):
    if weights == "fp32":
        engine = Engine.from_pretrained(cache_bytes=0)
        model = engine.model
        engine.close()
        return model
    return load_weights(weights, None)[0]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def copies_of(kv: SequenceKV, adapter: ModelAdapter, context: int, n: int) -> list[SequenceKV]:
    """n copies of kv's first `context` positions, each with room for a few more (rows with nothing
    shared: no key read twice)."""
    copies = []
    for _ in range(n):
        other = SequenceKV(adapter.geometry, context + 8, adapter.device)
        other.load(kv.export(0, context), 0)
        copies.append(other)
    return copies


def measure(weights: str, context: int, rows: list[int], repeats: int, threads: int) -> dict:
    model = load(weights)
    adapter = ModelAdapter(model)
    decoder, reason = native_decoder(adapter, threads=threads)
    if decoder is None:
        raise SystemExit(f"the native step cannot run here: {reason}")
    ids = [1000 + (7 * i) % 20000 for i in range(context)]
    capacity = context + 8
    with torch.inference_mode():
        decoder.prefill(SequenceKV(adapter.geometry, 160, adapter.device), ids[:128], 0)      # warm-up
        kv = SequenceKV(adapter.geometry, capacity, adapter.device)
        prefill_s = timed(lambda: decoder.prefill(kv, ids, 0))
        copies = copies_of(kv, adapter, context, min(UNSHARED_MAX, max(rows)))
        # the shared rows write their K and V into one slot, so they take one token: with different ones the
        # slot's contents would depend on which thread wrote last (the same work either way)
        shapes = {("shared", m): [(kv, 5, context)] * m for m in rows}
        shapes.update({("unshared", m): [(copies[i], 5 + i, context) for i in range(m)]
                       for m in rows if m <= UNSHARED_MAX})
        for items in shapes.values():
            decoder.decode_rows(items)                                  # warm-up
        samples: dict = {key: [] for key in shapes}
        for _ in range(repeats):
            for key, items in shapes.items():
                samples[key].append(timed(lambda: decoder.decode_rows(items)))
    decoder.close()
    out: dict = {"prefill_tokens": context, "prefill_tok_s": round(context / prefill_s, 1)}
    for kind in ("shared", "unshared"):
        steps = {m: statistics.median(samples[(kind, m)]) for m in rows if (kind, m) in samples}
        one = steps[1]
        out[kind] = [{"rows": m, "step_ms": round(1000 * s, 2), "ms_per_row": round(1000 * s / m, 2),
                      "speedup": round(m * one / s, 2)} for m, s in steps.items()]
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default="fp32,int4")
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--rows", default="1,4,8,16,64")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="context 100, rows 1,8, 3 repeats")
    parser.add_argument("--out", default="benchmarks/results/native_rows.json")
    args = parser.parse_args(argv)
    if args.smoke:
        args.context, args.rows, args.repeats = 100, "1,8", 3
    torch.set_num_threads(args.threads)
    rows = [int(m) for m in args.rows.split(",")]
    if rows[0] != 1:
        rows = [1, *rows]
    result: dict = {"command": "python -m benchmarks.micro.native_rows " + " ".join(sys.argv[1:] if argv is None else argv),
                    "context": args.context, "repeats": args.repeats}
    for weights in args.weights.split(","):
        result[weights] = measure(weights, args.context, rows, args.repeats, args.threads)
        print(weights, "prefill", result[weights]["prefill_tok_s"], "tok/s", flush=True)
        for kind in ("shared", "unshared"):
            for row in result[weights][kind]:
                print(f"  {weights} {kind:8s} M={row['rows']:3d} step {row['step_ms']:8.2f} ms  "
                      f"per row {row['ms_per_row']:7.2f} ms  speedup {row['speedup']:5.2f}x", flush=True)
    result["environment"] = environment(torch.nn.Linear(1, 1))
    result["environment"]["model"] = "SmolLM2-135M-Instruct (GGUF Q4_1 dequantized)"
    if not args.smoke:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print("wrote", args.out)


if __name__ == "__main__":
    main()
