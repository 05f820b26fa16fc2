"""KV on 2 MB pages against 4 KB pages (kv/hugepages.py): one native decode step of one row at
several context lengths, in one process, the two KV buffers visited alternately (the machine's
drift falls on both alike).

Per model and context: the same decoder over two SequenceKV buffers holding the same prefilled
context, one from kv/hugepages.empty (MADV_HUGEPAGE) and one from torch.empty (4 KB pages where THP
runs in `madvise` mode, as here); ms per step, median over --repeats rounds of 4 steps each.
Models: default (weights="int4") and 1.7b (the random SmolLM2-1.7B-shape Q4_0 GGUF, as stored).
Run alone (about 3 minutes on 2 cores), no OMP_WAIT_POLICY:
  python -m benchmarks.micro.kv_pages [--model default,1.7b] [--context 512,2048,4096]
      [--repeats 11] [--out benchmarks/results/kv_pages.json]
Smoke: python -m benchmarks.micro.kv_pages --smoke
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
from kvboost_engine.kv import hugepages
from kvboost_engine.kv.contiguous import SequenceKV
from kvboost_engine.model.arch import ModelAdapter
from kvboost_engine.native.decoder import native_decoder

from .._common import environment
from ..gguf_models import model_file

STEPS = 4                   # steps per timed sample


def _engine(model: str) -> Engine:
    if model == "default":
        return Engine.from_pretrained(weights="int4", cache_bytes=0)
    return Engine.from_pretrained(str(model_file(model, "q4_0")), cache_bytes=0)


def _buffer(adapter: ModelAdapter, capacity: int, huge: bool) -> SequenceKV:
    kv = SequenceKV(adapter.geometry, capacity, adapter.device)
    g = adapter.geometry
    shape = (2, g.num_layers, 1, g.kv_heads, capacity, g.head_dim)
    kv.data = hugepages.empty(shape, g.dtype) if huge else torch.empty(shape, dtype=g.dtype)
    return kv


def measure(model: str, contexts: list[int], repeats: int, threads: int) -> list[dict]:
    engine = _engine(model)
    adapter = ModelAdapter(engine.model)
    decoder, reason = native_decoder(adapter, threads=threads)
    if decoder is None:
        raise SystemExit(f"the native step cannot run here: {reason}")
    ids = [1000 + (7 * i) % 20000 for i in range(max(contexts))]
    rows = []
    with torch.inference_mode():
        for context in contexts:
            kvs = {"2M": _buffer(adapter, context + 8, True), "4k": _buffer(adapter, context + 8, False)}
            for kv in kvs.values():
                decoder.prefill(kv, ids[:context], 0)
            samples: dict = {name: [] for name in kvs}
            for r in range(repeats + 1):
                for name in (("4k", "2M") if r % 2 else ("2M", "4k")):
                    start = time.perf_counter()
                    for i in range(STEPS):
                        decoder(kvs[name], 5 + i, context)
                    if r:                                           # the first round warms up
                        samples[name].append((time.perf_counter() - start) / STEPS)
            huge, small = (statistics.median(samples[name]) for name in ("2M", "4k"))
            rows.append({"model": model, "context": context, "step_ms_2m_pages": round(1000 * huge, 2),
                         "step_ms_4k_pages": round(1000 * small, 2), "speedup": round(small / huge, 3),
                         "kv_bytes": kvs["2M"].data.numel() * kvs["2M"].data.element_size()})
            print(f"{model} @{context}: 2 MB pages {1000 * huge:.2f} ms, 4 KB pages {1000 * small:.2f} ms, "
                  f"{small / huge:.3f}x", flush=True)
            del kvs
    decoder.close()
    engine.close()
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default,1.7b")
    parser.add_argument("--context", default="512,2048,4096")
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="default model, context 64, 2 repeats")
    parser.add_argument("--out", default="benchmarks/results/kv_pages.json")
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.context, args.repeats = "default", "64", 2
    if not hugepages.available():
        raise SystemExit("no MADV_HUGEPAGE here (or KVBOOST_HUGEPAGES=0): nothing to compare")
    torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.context.split(",")]
    result: dict = {"command": "python -m benchmarks.micro.kv_pages " + " ".join(sys.argv[1:] if argv is None else argv),
                    "repeats": args.repeats, "steps_per_sample": STEPS, "threads": args.threads,
                    "thp": Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
                    if Path("/sys/kernel/mm/transparent_hugepage/enabled").exists() else None, "rows": []}
    for model in args.model.split(","):
        result["rows"] += measure(model, contexts, args.repeats, args.threads)
    result["environment"] = environment(torch.nn.Linear(1, 1))
    if not args.smoke:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print("wrote", args.out)


if __name__ == "__main__":
    main()
