"""Disk tier throughput: write and read one KV entry the size of a 2k-token SmolLM2-135M prefix.

    python -m benchmarks.micro.disk_tier [--dir /tmp] [--tokens 2048] [--repeats 5] [--out FILE]

No model: a random tensor [2, 30 layers, 3 kv heads, tokens, 64] (fp32: 94 MB at 2048 tokens).
put is timed with and without fsync; get warm (file in the page cache) and cold (pages
dropped with posix_fadvise after the fsync). Medians over repeats.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvboost_engine.kv.disk import DiskTier
from kvboost_engine.kv.disk.layout import entry_path

from .._common import drop_page_cache

LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64
FINGERPRINT = b"disk-tier-bench!"


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def measure(directory: Path, dtype: torch.dtype, n_tokens: int, repeats: int, fsync: bool) -> dict:
    """Median seconds and bytes/s of put, warm get and cold get for one entry size."""
    kv = torch.randn(2, LAYERS, KV_HEADS, n_tokens, HEAD_DIM).to(dtype)
    tokens = tuple(range(n_tokens))
    tier = DiskTier(directory, (repeats + 1) * 2 * kv.numel() * kv.element_size(), FINGERPRINT, fsync=fsync)
    puts, warm, cold = [], [], []
    for i in range(repeats):
        key = i.to_bytes(16, "little")
        puts.append(timed(lambda: tier.put(key, 0, tokens, kv, True)))
        warm.append(timed(lambda: tier.get(key)))
        if fsync:                                # DONTNEED only drops pages already on disk
            drop_page_cache(entry_path(tier.root, key))
            cold.append(timed(lambda: tier.get(key)))
    size = tier.stats()["bytes_written"] // repeats
    assert tier.stats()["hits"] == len(warm) + len(cold) and torch.equal(tier.get(key)[2], kv)
    out = {"dtype": str(dtype), "tokens": n_tokens, "entry_bytes": size, "fsync": fsync}
    for name, times in (("put", puts), ("get_warm", warm), ("get_cold", cold)):
        if times:
            median = statistics.median(times)
            out[f"{name}_s"] = round(median, 4)
            out[f"{name}_MB_s"] = round(size / median / 1e6)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "disk_tier.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    results = []
    for dtype, fsync in ((torch.float32, True), (torch.float32, False), (torch.bfloat16, True)):
        work = Path(tempfile.mkdtemp(prefix="kvboost-disk-bench-", dir=args.dir))
        try:
            results.append(measure(work, dtype, args.tokens, args.repeats, fsync))
        finally:
            shutil.rmtree(work)
        print(json.dumps(results[-1]))
    record = {"results": results, "repeats": args.repeats, "dir": args.dir,
              "cpu_count": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
              "load_average": os.getloadavg()[0], "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d")}
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
