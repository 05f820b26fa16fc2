"""One decode step at a long context (#29): the native step against the PyTorch layer loop, on the same
weights and the same KV, at each context length and KV element type.

Per weights (--weights, default fp32,int4) and KV dtype (--kv-dtypes, default float32,float16,int8):
  native_ms@N    one decode step of one sequence after N tokens of context (native/decoder.py), ms
  pytorch_ms@N   the same step through the PyTorch layer loop (model/forward.py without the native step)
  speedup@N      pytorch_ms / native_ms
Each context's KV is prefilled once (natively); then --repeats rounds each time one native step and one
PyTorch step at every KV dtype and context in turn (the machine's drift falls on all alike); medians.
The step writes position N's K and V each time (the same slot), so the context does not grow. The
PyTorch loop over weights="int4" (packed codes) decodes each matrix to float32 on every forward: that
path is for prompt chunks, and its decode step is here to show what a step costs where the native
step cannot run.

Run alone on a quiet machine (about 3 minutes on 2 cores), no OMP_WAIT_POLICY:
  python -m benchmarks.micro.native_context [--weights fp32,int4]
      [--kv-dtypes float32,float16,int8] [--contexts 500,2000,4000] [--repeats 10]
      [--out benchmarks/results/native_context.json]
Smoke: python -m benchmarks.micro.native_context --smoke
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from kvboost_engine.kv.contiguous import SequenceKV
from kvboost_engine.model.arch import ModelAdapter
from kvboost_engine.model.forward import Forward
from kvboost_engine.native.decoder import native_decoder

from .._common import environment, save_result
from .native_rows import load


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def setup(model, kv_dtype: str, contexts: list[int], threads: int) -> tuple:
    """(native decoder, PyTorch loop, {context: its KV prefilled}) over one KV dtype."""
    adapter = ModelAdapter(model, getattr(torch, kv_dtype))
    decoder, reason = native_decoder(adapter, threads=threads)
    if decoder is None:
        raise SystemExit(f"the native step cannot run here: {reason}")
    loop = Forward(adapter)                                  # no fast_decode: the PyTorch layer loop
    ids = [1000 + (7 * i) % 20000 for i in range(max(contexts))]
    kvs = {}
    for n in contexts:
        kvs[n] = SequenceKV(adapter.geometry, n + 1, adapter.device)
        decoder.prefill(kvs[n], ids[:n], 0)
        decoder(kvs[n], 42, n)                               # warm-up of both paths
        loop(kvs[n], [42], n)
    return decoder, loop, kvs


def measure(model, kv_dtypes: list[str], contexts: list[int], repeats: int, threads: int) -> dict:
    """Every KV dtype and context of one model, in rounds that visit each in turn."""
    setups = {kv: setup(model, kv, contexts, threads) for kv in kv_dtypes}
    native = {(kv, n): [] for kv in kv_dtypes for n in contexts}
    pytorch = {(kv, n): [] for kv in kv_dtypes for n in contexts}
    for _ in range(repeats):
        for kv, (decoder, loop, kvs) in setups.items():
            for n in contexts:
                native[kv, n].append(timed(lambda: decoder(kvs[n], 42, n)))
                pytorch[kv, n].append(timed(lambda: loop(kvs[n], [42], n)))
    out: dict = {kv: {} for kv in kv_dtypes}
    for kv, n in native:
        a, b = statistics.median(native[kv, n]), statistics.median(pytorch[kv, n])
        out[kv][str(n)] = {"native_ms": round(1000 * a, 2), "pytorch_ms": round(1000 * b, 2), "speedup": round(b / a, 2)}
    for decoder, _, _ in setups.values():
        decoder.close()
    return out


def table(result: dict) -> str:
    contexts = result["contexts"]
    lines = ["| weights, KV | " + " | ".join(f"{n} tokens: native / PyTorch ms" for n in contexts) + " |",
             "|---|" + "---|" * len(contexts)]
    for key, rows in result["runs"].items():
        lines.append(f"| {key} | " + " | ".join(f"{rows[str(n)]['native_ms']} / {rows[str(n)]['pytorch_ms']} "
                                                f"({rows[str(n)]['speedup']}x)" for n in contexts) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default="fp32,int4")
    parser.add_argument("--kv-dtypes", default="float32,float16,int8")
    parser.add_argument("--contexts", default="500,2000,4000")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="contexts 64,128, int4, float32 KV, 2 repeats")
    parser.add_argument("--out", default="benchmarks/results/native_context.json")
    args = parser.parse_args(argv)
    if args.smoke:
        args.weights, args.kv_dtypes, args.contexts, args.repeats = "int4", "float32", "64,128", 2
    torch.set_num_threads(args.threads)
    contexts = [int(n) for n in args.contexts.split(",")]
    result: dict = {"command": "python -m benchmarks.micro.native_context " + " ".join(sys.argv[1:] if argv is None else argv),
                    "contexts": contexts, "repeats": args.repeats, "runs": {}}
    with torch.inference_mode():
        for weights in args.weights.split(","):
            model = load(weights)
            kv_dtypes = args.kv_dtypes.split(",")
            for kv_dtype, rows in measure(model, kv_dtypes, contexts, args.repeats, args.threads).items():
                result["runs"][f"{weights}, {kv_dtype} KV"] = rows
                print(f"{weights}, {kv_dtype} KV", rows, flush=True)
            del model
    result["environment"] = environment(torch.nn.Linear(1, 1))
    result["environment"]["model"] = "SmolLM2-135M-Instruct (GGUF Q4_1 dequantized)"
    print(table(result))
    if not args.smoke:
        print("wrote", save_result(result, args.out, "native_context"))


if __name__ == "__main__":
    main()
