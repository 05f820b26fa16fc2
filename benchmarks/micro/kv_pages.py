"""KV on 2 MB transparent huge pages against the engine's 4 KB pages: one native decode step of one
row at several context lengths, in one process, the buffers visited in turn (the machine's drift
falls on all alike), and the memory a short request commits in a large pool. A measurement of why
the engine keeps its KV on ordinary pages (README, "KV and huge pages").

Per model and context, the same decoder and the same KV (prefilled once, copied) in:
  pool_4k        the block pool as the engine builds it: [2, layers, kv_heads, slots, head_dim], torch.empty
                 (4 KB pages where THP runs in `madvise` mode, as here and on most Linux machines)
  pool_2m        the same layout on 2 MB pages (a private anonymous mapping advised MADV_HUGEPAGE)
  pool_2m_slots  slot-major memory [2, layers, slots, kv_heads, head_dim] on 2 MB pages, seen through
                 the same [2, layers, kv_heads, slots, head_dim] view (fewer, larger regions)
  seq_4k, seq_2m a SequenceKV buffer (paged=False) on 4 KB / 2 MB pages
ms per step, median over --repeats rounds of 4 steps each; speedups against pool_4k / seq_4k.
Committed memory: the resident bytes a 64-token request adds to a fresh 2 GB pool in each pool
layout (2 MB pages commit 2 MB per region touched: per (K or V, layer, KV head) head-major, per
(K or V, layer) slot-major).
Models: default (weights="int4") and 1.7b (the random SmolLM2-1.7B-shape Q4_0 GGUF, as stored).
Run alone (about 5 minutes on 2 cores; Linux with MADV_HUGEPAGE), no OMP_WAIT_POLICY:
  python -m benchmarks.micro.kv_pages [--model default,1.7b] [--context 512,2048,4096]
      [--repeats 9] [--out benchmarks/results/kv_pages.json]
Smoke: python -m benchmarks.micro.kv_pages --smoke
"""
from __future__ import annotations

import argparse
import mmap
import statistics
import sys
import time
from pathlib import Path

import torch

from kvboost_engine import Engine
from kvboost_engine.kv.contiguous import SequenceKV
from kvboost_engine.kv.paged import PagedSequence
from kvboost_engine.kv.pool import BlockPool
from kvboost_engine.model.arch import ModelAdapter
from kvboost_engine.native.decoder import native_decoder

from .._common import environment, save_result
from ..gguf_models import model_file

STEPS = 4                   # steps per timed sample
POOL_BYTES = 2 << 30        # each pool's budget at least
HUGE = 2 << 20
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor on 2 MB-aligned memory advised MADV_HUGEPAGE (kept alive by it)."""
    size = torch.Size(shape)
    nbytes = size.numel() * torch.empty((), dtype=dtype).element_size()
    region = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(region, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE
    return whole[start:start + nbytes].view(dtype).view(size)


def _engine(model: str) -> Engine:
    if model == "default":
        return Engine.from_pretrained(weights="int4", cache_bytes=0)
    return Engine.from_pretrained(str(model_file(model, "q4_0")), cache_bytes=0)


def _sequence(adapter: ModelAdapter, capacity: int, huge: bool) -> SequenceKV:
    kv = SequenceKV(adapter.geometry, capacity, adapter.device)
    if huge:
        kv.data = huge_empty(kv.data.shape, kv.data.dtype)
    return kv


def _paged(adapter: ModelAdapter, capacity: int, layout: str) -> PagedSequence:
    """A sequence over a pool of its own, its RAM in `layout` (module docstring)."""
    g = adapter.geometry
    pool = BlockPool(g, max((capacity + 64) * g.bytes_per_token, POOL_BYTES), adapter.device)
    shape = pool.ram.shape                                    # [2, layers, kv_heads, slots, head_dim]
    if layout == "pool_2m":
        pool.ram = huge_empty(shape, g.dtype)
    elif layout == "pool_2m_slots":
        pool.ram = huge_empty((shape[0], shape[1], shape[3], shape[2], shape[4]), g.dtype).permute(0, 1, 3, 2, 4)
    seq = PagedSequence(pool, capacity)
    seq.reserve()
    return seq


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


POOLS = ("pool_4k", "pool_2m", "pool_2m_slots")


def committed(adapter: ModelAdapter) -> dict:
    """Resident bytes a 64-token request adds to a fresh 2 GB pool, per pool layout."""
    g = adapter.geometry
    kv = torch.randn(2, g.num_layers, g.kv_heads, 64, g.head_dim)
    out = {"request_kv_bytes": 64 * g.bytes_per_token, "pool_bytes": POOL_BYTES}
    for layout in POOLS:
        before = _rss()
        seq = _paged(adapter, 64, layout)
        seq.pool.write(seq.table, 0, kv)
        out[layout] = _rss() - before
        del seq
    return out


def measure(model: str, contexts: list[int], repeats: int, threads: int) -> list[dict]:
    engine = _engine(model)
    adapter = ModelAdapter(engine.model)
    decoder, reason = native_decoder(adapter, threads=threads)
    if decoder is None:
        raise SystemExit(f"the native step cannot run here: {reason}")
    ids = [1000 + (7 * i) % 20000 for i in range(max(contexts))]
    rows = [{"model": model, "committed_bytes": committed(adapter)}]
    print(model, "bytes committed by a 64-token request in a 2 GB pool:", rows[0]["committed_bytes"], flush=True)
    with torch.inference_mode():
        for context in contexts:
            capacity = context + 8
            kvs = {layout: _paged(adapter, capacity, layout) for layout in POOLS}
            kvs.update(seq_4k=_sequence(adapter, capacity, False), seq_2m=_sequence(adapter, capacity, True))
            decoder.prefill(kvs["seq_4k"], ids[:context], 0)
            values = kvs["seq_4k"].data[:, :, 0, :, :context]
            kvs["seq_2m"].data[:, :, 0, :, :context] = values
            for layout in POOLS:
                kvs[layout].pool.write(kvs[layout].table, 0, values)
            samples: dict = {name: [] for name in kvs}
            order = list(kvs)
            for r in range(repeats + 1):
                for name in (order if r % 2 else order[::-1]):
                    start = time.perf_counter()
                    for i in range(STEPS):
                        decoder(kvs[name], 5 + i, context)
                    if r:                                           # the first round warms up
                        samples[name].append((time.perf_counter() - start) / STEPS)
            ms = {name: 1000 * statistics.median(v) for name, v in samples.items()}
            row = {"model": model, "context": context, **{f"step_ms_{k}": round(v, 2) for k, v in ms.items()},
                   "speedup_pool_2m": round(ms["pool_4k"] / ms["pool_2m"], 3),
                   "speedup_pool_2m_slots": round(ms["pool_4k"] / ms["pool_2m_slots"], 3),
                   "speedup_seq_2m": round(ms["seq_4k"] / ms["seq_2m"], 3)}
            rows.append(row)
            print(f"{model} @{context}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items())
                  + f"; speedups pool_2m {row['speedup_pool_2m']:.3f}x, pool_2m_slots "
                  f"{row['speedup_pool_2m_slots']:.3f}x, seq_2m {row['speedup_seq_2m']:.3f}x", flush=True)
            del kvs, values
    decoder.close()
    engine.close()
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default,1.7b")
    parser.add_argument("--context", default="512,2048,4096")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="default model, context 64, 2 repeats")
    parser.add_argument("--out", default="benchmarks/results/kv_pages.json")
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.context, args.repeats = "default", "64", 2
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        raise SystemExit("no MADV_HUGEPAGE here: nothing to compare")
    torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.context.split(",")]
    result: dict = {"command": "python -m benchmarks.micro.kv_pages " + " ".join(sys.argv[1:] if argv is None else argv),
                    "repeats": args.repeats, "steps_per_sample": STEPS, "threads": args.threads,
                    "thp": THP.read_text().strip() if THP.exists() else None, "rows": []}
    for model in args.model.split(","):
        result["rows"] += measure(model, contexts, args.repeats, args.threads)
    result["environment"] = environment(torch.nn.Linear(1, 1))
    if not args.smoke:
        print("wrote", save_result(result, args.out, "kv_pages"))


if __name__ == "__main__":
    main()
