"""Perplexity through our engine against llama-perplexity on the same GGUF and the same windows (#28).

llama-perplexity (benchmarks/llama_tools.sh) runs on the evaluation text (kvboost_tools.awq.texts,
written to a file) with `-c CTX -b CTX --chunks N`: the text's tokens (llama.cpp's own tokenizer) are
cut into N windows of CTX tokens, the first token of each replaced by BOS where the model adds BOS,
and the next-token loss is counted on the second half of each window only (positions CTX/2 ..
CTX-2 predicting the following token). Its tokens are read back from its --kl-divergence-base file,
so our side scores exactly the same token ids and windows.

Ours, in a fresh process (Engine.from_pretrained(gguf, weights="gguf"): as stored; threads as given), per window:
  decode   (default) the first CTX/2 + 1 tokens in one forward (the engine's prefill path), then one
           token at a time through the engine's decode step (the native step where the engine takes
           it): the arithmetic a user's generation runs through
  hf       engine.model(ids).logits over the window: the HF module tree the engine holds (only
           where the loaded model is still one)
Reported: both perplexities and ours / llama.cpp - 1 (the issue asks within 1%).

Run: python -m benchmarks.micro.gguf_ppl --model default --format q4_1,q4_0 [--ctx 512 --chunks 6 \
       --mode decode --side both] ; results merged into benchmarks/results/gguf_ppl.json
KV element type (#29): `--kv-dtype int8` runs ours with EngineConfig.kv_dtype="int8", `--llama-kv q8_0`
llama-perplexity with `-ctk q8_0 -ctv q8_0 -fa on` (the same numbers: int8 per block of 32, f16 scale):
  python -m benchmarks.micro.gguf_ppl --model gemma3 --format q4_k_m --weights fp32 --kv-dtype int8 --llama-kv q8_0
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ..gguf_models import MODEL_FORMATS, model_file, tools_dir
from .gguf import anchor_env


def llama_perplexity(path: Path, args) -> dict:
    """llama-perplexity's PPL on the evaluation text, and the token windows it scored."""
    from kvboost_tools.awq.texts import evaluation_text
    with tempfile.TemporaryDirectory() as tmp:
        text, logits = Path(tmp) / "eval.txt", Path(tmp) / "logits.bin"
        text.write_text(evaluation_text())
        cmd = [str(tools_dir(args.llama_variant) / "bin" / "llama-perplexity"), "-m", str(path), "-f", str(text),
               "-c", str(args.ctx), "-b", str(args.ctx), "--chunks", str(args.chunks), "-t", str(args.threads),
               "--kl-divergence-base", str(logits)]
        if args.llama_kv != "f16":                 # a quantized V cache needs flash attention
            cmd += ["-ctk", args.llama_kv, "-ctv", args.llama_kv, "-fa", "on"]
        started = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, env=anchor_env())
        seconds = time.perf_counter() - started
        if done.returncode != 0:
            raise RuntimeError(f"llama-perplexity exited {done.returncode}: {done.stderr.strip()[-400:]}")
        with open(logits, "rb") as f:
            assert f.read(8) == b"_logits_"
            n_ctx, n_vocab, n_chunk = np.frombuffer(f.read(12), dtype=np.int32)
            tokens = np.frombuffer(f.read(4 * n_ctx * n_chunk), dtype=np.int32).tolist()
    found = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", done.stderr + done.stdout)
    return {"ppl": float(found.group(1)), "ppl_stderr": float(found.group(2)), "seconds": seconds,
            "n_ctx": int(n_ctx), "n_chunk": int(n_chunk), "n_vocab": int(n_vocab), "tokens": tokens}


def ours(path: str, tokens: list[int], n_ctx: int, mode: str, threads: int, kv_dtype: str = "",
         weights: str = "gguf") -> dict:
    """Our perplexity over llama-perplexity's windows (see the module docstring)."""
    import torch

    from kvboost_engine import Engine
    torch.set_num_threads(threads)
    engine = Engine.from_pretrained(path, weights=weights, cache_bytes=0,     # "gguf": as stored, whatever the
                                    kv_dtype=kv_dtype or None)                  # architecture; "fp32": dequantized
    bos = engine.tokenizer.bos_token_id
    add_bos = bos is not None and tokens[0] == bos            # llama.cpp tokenized with a leading BOS
    first, nll, count = n_ctx // 2, 0.0, 0
    started = time.perf_counter()
    for start in range(0, len(tokens), n_ctx):
        window = list(tokens[start:start + n_ctx])
        if add_bos:
            window[0] = bos
        for logits, target in window_logits(engine, window, first, mode):
            nll -= float(torch.log_softmax(logits.float(), dim=-1)[target])
            count += 1
    out = {"ppl": math.exp(nll / count), "scored": count, "seconds": time.perf_counter() - started,
           "native_decode": engine.stats().get("native_decode"), "add_bos": add_bos}
    engine.close()
    return out


def window_logits(engine, window: list[int], first: int, mode: str):
    """(logits, next token) for positions first .. len(window) - 2 of one window."""
    import torch
    if mode == "hf":
        with torch.inference_mode():
            logits = engine.model(torch.tensor([window])).logits[0]
        for pos in range(first, len(window) - 1):
            yield logits[pos], window[pos + 1]
        return
    from kvboost_engine.kv.contiguous import SequenceKV
    from kvboost_engine.model.forward import Forward
    from kvboost_engine.native.decoder import native_decoder
    adapter = engine.adapter
    fast = native_decoder(adapter)[0] if engine.stats()["native_decode"] else None
    forward, kv = Forward(adapter, fast), SequenceKV(adapter.geometry, len(window), adapter.device)
    with torch.inference_mode():
        logits = forward(kv, window[:first + 1], 0)
        for pos in range(first, len(window) - 1):
            yield logits, window[pos + 1]
            if pos + 1 < len(window) - 1:
                logits = forward(kv, [window[pos + 1]], pos + 1)


def measure(model: str, fmt: str, args) -> dict:
    path = model_file(model, fmt)
    row = {"model": model, "format": fmt, "file": str(path), "ctx": args.ctx, "mode": args.mode,
           "kv_dtype": args.kv_dtype or "model", "llama_kv": args.llama_kv, "weights": args.weights}
    try:
        ref = llama_perplexity(path, args)
    except RuntimeError as error:
        return {**row, "status": str(error)}
    tokens = ref.pop("tokens")
    row.update({"llama_" + k: v for k, v in ref.items()})
    if args.side == "llama":
        return row
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(tokens, f)
    try:
        cmd = [sys.executable, "-m", "benchmarks.micro.gguf_ppl", "--child", f.name, "--path", str(path),
               "--ctx", str(ref["n_ctx"]), "--mode", args.mode, "--threads", str(args.threads), "--kv-dtype", args.kv_dtype,
               "--weights", args.weights]
        done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS=str(args.threads)))
    finally:
        os.unlink(f.name)
    if done.returncode != 0:
        return {**row, "status": "ours failed: " + " | ".join(done.stderr.strip().splitlines()[-3:])[-400:]}
    mine = json.loads(done.stdout.strip().splitlines()[-1])
    row.update({"ours_" + k: v for k, v in mine.items()})
    row["ours_vs_llama"] = mine["ppl"] / ref["ppl"] - 1
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help=f"comma list of {', '.join(MODEL_FORMATS)}")
    parser.add_argument("--format", default="", help="comma list of GGUF formats (default: each model's)")
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=6, help="windows (the evaluation text has ~3.1k tokens: 6 of 512)")
    parser.add_argument("--mode", choices=("decode", "hf"), default="decode")
    parser.add_argument("--side", choices=("both", "llama"), default="both")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-variant", default="")
    parser.add_argument("--kv-dtype", default="", help="our KV element type (EngineConfig.kv_dtype; default: the model's)")
    parser.add_argument("--llama-kv", default="f16", help="llama-perplexity's KV cache type (-ctk / -ctv; f16 or q8_0)")
    parser.add_argument("--weights", default="gguf", help="ours: the file as stored (gguf) or dequantized to float32 "
                        "(fp32: models the native step does not run, such as Gemma 3, decode ~100x faster so)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gguf_ppl.json"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        tokens = json.loads(Path(args.child).read_text())
        print(json.dumps(ours(args.path, tokens, args.ctx, args.mode, args.threads, args.kv_dtype, args.weights)))
        return
    rows = []
    for model in args.model.split(","):
        formats = [f for f in args.format.split(",") if f] or MODEL_FORMATS[model]
        for fmt in (f for f in formats if f != "hf-int4" and ":" not in f):
            rows.append(measure(model, fmt, args))
            print(json.dumps(rows[-1]), file=sys.stderr)
    result = json.loads(args.out.read_text()) if args.out.is_file() else {"benchmark": "gguf_ppl", "rows": []}
    key = lambda r: (r["model"], r["format"], r["ctx"], r["mode"], r.get("kv_dtype", "model"), r.get("llama_kv", "f16"),
                     r.get("weights", "gguf"))
    keys = {key(r) for r in rows}
    result["rows"] = [r for r in result["rows"] if key(r) not in keys] + rows
    result.setdefault("runs", []).append({**{k: v for k, v in vars(args).items() if k not in ("out", "child", "path")},
                                          "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                          "load_average": os.getloadavg()})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print("| model | format | ctx x chunks | llama-perplexity | ours (" + args.mode + ") | ours / llama.cpp - 1 |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "status" in r:
            print(f"| {r['model']} | {r['format']} | {r['status'][:150]} ||||")
            continue
        ours_ppl = f"{r['ours_ppl']:.4f}" if "ours_ppl" in r else "-"
        rel = f"{100 * r['ours_vs_llama']:+.3f}%" if "ours_vs_llama" in r else "-"
        print(f"| {r['model']} | {r['format']} | {r['llama_n_ctx']} x {r['llama_n_chunk']} | "
              f"{r['llama_ppl']:.4f} ± {r['llama_ppl_stderr']:.4f} | {ours_ppl} | {rel} |")


if __name__ == "__main__":
    main()
