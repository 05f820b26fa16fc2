"""Native steps (#29): our prefill and decode against llama.cpp's llama-bench, per model, at 0, 512 and
4,096 tokens of context, same threads.

Configurations (ours; each in a fresh process, `--threads` torch/OpenMP threads):
  default  fp32    Engine.from_pretrained()                      (the exact float32 default model)
           int4    Engine.from_pretrained(weights="int4")
           q4_0    Engine.from_pretrained(<the default model's Q4_0 GGUF>)   (packed codes as stored)
  1.7b     q4_0    Engine.from_pretrained(<the random SmolLM2-1.7B-shape Q4_0 GGUF>)
           q4_k_m  Engine.from_pretrained(<its Q4_K_M GGUF>)   (Q4_K layers, Q6_K v / down / head: the file a
                   user most often has; only where --config names it)
           q5_k_m  Engine.from_pretrained(<its Q5_K_M GGUF>)   (Q5_K layers, Q6_K v / down / head; only where
                   --config names it, against --llama-format q5_k_m)
  qwen3-1.7b q4_0  Engine.from_pretrained(<the random Qwen3-1.7B-shape Q4_0 GGUF>)   (q/k norms, head_dim
                   128, a 151,936-row tied head; not in the default --model list)
  gemma3-1b q4_0   Engine.from_pretrained(<the random Gemma 3 1B-shape Q4_0 GGUF>)   (4 query heads over 1
                   KV head of 256, windows on 5 layers of 6, a 262,144-row tied head; not in the default list)
  llama3-8b q4_0   Engine.from_pretrained(<the random Llama-3.1-8B-shape Q4_0 GGUF>)   (8 KV heads of 128 for
                   32 query heads, llama3 rotary scaling, an untied Q6_K head; not in the default list:
                   --depths 0,512 keeps it to ~10 minutes)
  gemma3   fp32    Engine.from_pretrained("gemma3-270m")          (Gemma 3 270M base, float32: the default)
           int4    Engine.from_pretrained("gemma3-270m", weights="int4")
           q4_k_m  Engine.from_pretrained(<its shipped Q4_K_M GGUF>)   (as stored; gemma3 runs where --model names it)
           q4_0    Engine.from_pretrained(<that file requantized to Q4_0>)
Every row is compared with llama.cpp on the model's Q4_0 GGUF (its best 4-bit format here, repacked), or
on the file of `--llama-format` (q4_k_m / q5_k_m: the same file as ours; on x86 llama.cpp repacks Q4_K, not
Q5_K / Q6_K):
  python -m benchmarks.micro.native_steps --model 1.7b --config q4_k_m --llama-format q4_k_m \
      --depths 0,512 --rounds 5 --out benchmarks/results/native_steps_1p7b_q4km_rounds_zen4.json

Ours:
  prefill_tok_s    a `--prefill-tokens` prompt (evaluation text) on an engine with cache_bytes=0 over the
                   same model: prompt tokens / TTFT, median of `--repeats` after one warm-up
  decode_tok_s@D   a prompt of D tokens (D=0: a one-line prompt), then `--decode-tokens` new tokens,
                   greedy with min_new_tokens (EOS cannot stop it): (tokens - 1) / (time after the
                   first token), median of `--repeats` (the first run, which also prefills the
                   context cold, is a warm-up; later runs reuse its KV, which only the TTFT sees)
llama.cpp (benchmarks/llama_tools.sh; the same file, same threads):
  llama-bench -t T -p P -n 0 -r R -m FILE -o json              prefill at depth 0
  llama-bench -t T -p 0 -n N -d D1,D2,.. -r R -m FILE -o json  decode at each depth (-d fills the
                   context first, untimed); median of its R samples_ts, all samples kept

Run alone (about 10 minutes on 2 cores, most of it the 1.7b model's 4,096-token contexts)
(no OMP_WAIT_POLICY: llama.cpp's tools always run without it, see gguf.anchor_env):
  python -m benchmarks.micro.native_steps [--model default,1.7b] [--depths 0,512,4096]
Instruction-set variants (#29): `--isa avx2,avxvnni` runs our rows once per variant of the native step
(KVBOOST_NATIVE_ISA in the child), `--llama-variant avx2` takes llama.cpp's AVX2-only build
(benchmarks/llama_tools.sh --avx2); the fair pair is our avx2 against llama.cpp's avx2:
  python -m benchmarks.micro.native_steps --config default:int4,1.7b:q4_0 \
      --isa avx2,avxvnni --llama-variant avx2 --out benchmarks/results/native_steps_avx2.json
KV element type: `--kv-dtype ,float16` runs each of our configurations with the model's KV dtype and
with float16 KV (EngineConfig.kv_dtype; llama.cpp's KV is f16, its default):
  python -m benchmarks.micro.native_steps --kv-dtype ,float16 --out benchmarks/results/native_steps_kv.json
int8 KV against llama.cpp's q8_0 KV (the same numbers: int8 per block of 32 with an f16 scale):
  python -m benchmarks.micro.native_steps --config default:int4,1.7b:q4_0 --kv-dtype float16,int8 \
      --llama-kv f16,q8_0 --out benchmarks/results/native_steps_int8kv.json
Rounds: `--rounds 3` runs the whole list three times, ours and llama.cpp alternating, and reports the
median speeds and the median of each round's ratio (a noisy machine's drift between processes then
shows as spread, not as one run's luck):
  python -m benchmarks.micro.native_steps --model 1.7b --kv-dtype ,float16,int8 --llama-kv f16,q8_0 \
      --depths 0,512 --rounds 3 --out benchmarks/results/native_steps_1p7b_rounds.json
Smoke: python -m benchmarks.micro.native_steps --smoke
Results: benchmarks/results/native_steps.json (--out); a table of ours / llama.cpp is printed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..gguf_models import home, model_file, tools_dir
from .gguf import PROMPT, _timed, _vm_kib

CONFIGS = {"default": ("fp32", "int4", "q4_0"), "1.7b": ("q4_0", "q4_k_m", "q5_k_m"), "qwen3-1.7b": ("q4_0",), "gemma3-1b": ("q4_0",),
           "llama3-8b": ("q4_0",),
           "gemma3": ("fp32", "int4", "q4_k_m", "q4_0")}
NAMED_ONLY = {("1.7b", "q4_k_m"), ("1.7b", "q5_k_m")}              # run only where --config names them


def context_ids(tokenizer, n: int) -> list[int]:
    from kvboost_tools.awq.texts import evaluation_text
    ids = tokenizer(evaluation_text())["input_ids"]
    return (ids * (n // len(ids) + 1))[:n]             # the text again past its end (~3.2k tokens)


# ---- ours, in a child process ----------------------------------------------------------------
def load(model: str, config: str, cache: bool, kv_dtype: str = ""):
    from kvboost_engine import Engine
    options = ({} if cache else {"cache_bytes": 0}) | ({"kv_dtype": kv_dtype} if kv_dtype else {})
    source = "gemma3-270m" if model == "gemma3" else None
    if config == "fp32":
        return Engine.from_pretrained(source, **options)
    if config == "int4":
        return Engine.from_pretrained(source, weights="int4", **options)
    return Engine.from_pretrained(str(model_file(model, config)), **options)


def measure_ours(args) -> dict:
    import torch

    from kvboost_engine import Engine
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    engine = load(args.model, args.child, cache=True, kv_dtype=args.kv_dtype)
    out = {"load_s": time.perf_counter() - started}
    tokenizer = engine.tokenizer
    cold = Engine(engine.model, tokenizer, cache_bytes=0, kv_dtype=engine.config.kv_dtype)  # prefill: nothing reused
    text = tokenizer.decode(context_ids(tokenizer, args.prefill_tokens))
    runs = [cold.generate(text, max_new_tokens=1) for _ in range(args.repeats + 1)][1:]
    out["prefill_tokens"] = runs[0].prompt_tokens
    out["prefill_reused_tokens"] = max(g.reused_tokens for g in runs)
    out["prefill_tok_s"] = runs[0].prompt_tokens / statistics.median(g.ttft_s for g in runs)
    out["prefill_samples_tok_s"] = [g.prompt_tokens / g.ttft_s for g in runs]
    cold.close()
    n = args.decode_tokens
    for depth in args.depth_list:
        prompt = PROMPT if depth == 0 else tokenizer.decode(context_ids(tokenizer, depth))
        gens = [engine.generate(prompt, max_new_tokens=n, min_new_tokens=n) for _ in range(args.repeats + 1)]
        speeds = [(len(g.token_ids) - 1) / max(g.total_s - g.ttft_s, 1e-9) for g in gens]
        out[f"decode_tok_s@{depth}"] = statistics.median(speeds[1:])
        out[f"decode_samples_tok_s@{depth}"] = speeds
        out[f"context_tokens@{depth}"] = gens[0].prompt_tokens
        out[f"cold_ttft_s@{depth}"] = gens[0].ttft_s
    stats = engine.stats()
    forced = os.environ.get("KVBOOST_NATIVE_ISA")
    if forced and stats.get("native_isa") != forced:
        raise SystemExit(f"KVBOOST_NATIVE_ISA={forced}, but the native step is {stats.get('native_isa')}: "
                         f"{stats.get('native_decode_off')}")
    out.update({k: v for k, v in stats.items() if k.startswith("native") or k in ("weights_format", "kv_dtype")})
    out["peak_rss_bytes"] = _vm_kib("VmHWM") * 1024
    engine.close()
    return out


def run_ours(model: str, config: str, args, isa: str = "", kv_dtype: str = "") -> dict:
    cmd = [sys.executable, "-m", "benchmarks.micro.native_steps", "--child", config, "--model", model,
           "--kv-dtype", kv_dtype,
           "--threads", str(args.threads), "--repeats", str(args.repeats), "--depths", args.depths,
           "--decode-tokens", str(args.decode_tokens), "--prefill-tokens", str(args.prefill_tokens)]
    row = {"model": model, "config": config, "side": "ours", "isa": isa or "best", "load_average": os.getloadavg(),
           "kv_dtype": kv_dtype or "model"}
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), **({"KVBOOST_NATIVE_ISA": isa} if isa else {}))
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        return {**row, "status": f"failed ({done.returncode}): " + " | ".join(done.stderr.strip().splitlines()[-3:])[-400:]}
    return {**row, **json.loads(done.stdout.strip().splitlines()[-1]), "process_s": time.perf_counter() - started}


# ---- llama.cpp -------------------------------------------------------------------------------
def llama_bench(path: Path, args, extra: list[str]) -> list[dict]:
    cmd = [str(tools_dir(args.llama_variant) / "bin" / "llama-bench"), "-t", str(args.threads), "-r", str(args.llama_repeats),
           "-m", str(path), "-o", "json", *extra]
    out, _, _, _ = _timed(cmd)
    return json.loads(out)


def run_llama(model: str, args, kv: str = "f16") -> dict:
    path = model_file(model, args.llama_format)
    row = {"model": model, "config": args.llama_format, "side": "llama.cpp", "file": str(path), "load_average": os.getloadavg(),
           "isa": args.llama_variant or "native build", "kv": kv}
    kv_args = [] if kv == "f16" else ["-ctk", kv, "-ctv", kv, "-fa", "on"]     # a quantized V needs flash attention
    bench = home() / f"llama-tools-{args.llama_variant}" / "bin" / "llama-bench"
    if args.llama_variant and not bench.is_file():         # never start a (long) build from here
        return {**row, "status": f"{bench} missing: run benchmarks/llama_tools.sh --{args.llama_variant} first"}
    started = time.perf_counter()
    try:
        tests = llama_bench(path, args, ["-p", str(args.prefill_tokens), "-n", "0", *kv_args])
        tests += llama_bench(path, args, ["-p", "0", "-n", str(args.decode_tokens), "-d", args.depths, *kv_args])
    except RuntimeError as error:
        return {**row, "status": str(error)}
    for test in tests:
        samples = test.get("samples_ts") or [test["avg_ts"]]
        key = "prefill_tok_s" if test["n_prompt"] else f"decode_tok_s@{test.get('n_depth', 0)}"
        row[key] = statistics.median(samples)
        row[key.replace("tok_s", "samples_tok_s")] = samples
    row.update({"bench_s": time.perf_counter() - started, "model_type": tests[0].get("model_type"),
                "build_commit": tests[0].get("build_commit"), "cpu_info": tests[0].get("cpu_info")})
    return row


# ---- report ----------------------------------------------------------------------------------
def table(rows: list[dict], depths: list[int]) -> str:
    """Speeds and ours / llama.cpp per configuration; over several rounds (--rounds), the median speed
    and the median of each round's ratio (ours against llama.cpp's row of the same round)."""
    keys = ["prefill_tok_s"] + [f"decode_tok_s@{d}" for d in depths]
    head = ["prefill"] + [f"decode @{d}" for d in depths]
    rounds = max((r.get("round", 0) for r in rows), default=0) + 1
    lines = ["| model | config | side | " + " | ".join(f"{h} tok/s" for h in head) + " | " +
             " | ".join(f"{h} / llama.cpp" for h in head) + " |", "|---" * (3 + 2 * len(keys)) + "|"]
    llama = {(r["model"], r.get("kv", "f16"), r.get("round", 0)): r
             for r in rows if r["side"] == "llama.cpp" and "status" not in r}
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["model"], r["config"], r["side"], r.get("isa"), r.get("kv_dtype") or r.get("kv")), []).append(r)
    for group in groups.values():
        r = group[0]
        failed = [g for g in group if "status" in g]
        if failed:
            lines.append(f"| {r['model']} | {r['config']} | {r['side']} | {failed[0]['status'][:160]} |")
            continue
        ratios = {k: [] for k in keys}
        for g in group:
            if g["side"] != "ours":
                continue
            # int8 KV against llama.cpp's q8_0 KV where it ran, else its f16 KV (the same round's)
            at = g.get("round", 0)
            ref = llama.get((g["model"], "q8_0" if g.get("kv_dtype") == "int8" else "f16", at)) \
                or llama.get((g["model"], "f16", at), {})
            for k in keys:
                if k in g and ref.get(k):
                    ratios[k].append(g[k] / ref[k])
        speeds = [f"{statistics.median(g[k] for g in group):.1f}" if all(k in g for g in group) else "-" for k in keys]
        shown = [f"{statistics.median(ratios[k]):.2f}x" if ratios[k] else "-" for k in keys]
        side = f"{r['side']} ({r.get('native_isa') or r.get('isa')})" if r.get("isa") else r["side"]
        kv = r.get("kv_dtype") or r.get("kv")
        config = f"{r['config']}, {kv} KV" if kv else r["config"]
        if rounds > 1:
            side += f", median of {len(group)}"
        lines.append(f"| {r['model']} | {config} | {side} | " + " | ".join(speeds + shown) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default,1.7b", help=f"comma list of {', '.join(CONFIGS)}")
    parser.add_argument("--config", default="", help="comma list of our configurations, each CONFIG or MODEL:CONFIG "
                        "(default: all of the model's)")
    parser.add_argument("--side", choices=("both", "ours", "llama"), default="both")
    parser.add_argument("--depths", default="0,512,4096")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--llama-repeats", type=int, default=3, help="llama-bench -r")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--smoke", action="store_true", help="default model, depths 0,32, 4 new tokens, "
                        "a 32-token prefill, 1 repeat; written to $TMPDIR/native_steps_smoke.json")
    parser.add_argument("--out", type=Path, default=None, help="default benchmarks/results/native_steps.json")
    parser.add_argument("--isa", default="", help="comma list of our native step's variants (avx512, avxvnni, "
                        "avx2: KVBOOST_NATIVE_ISA); default: the best this CPU runs")
    parser.add_argument("--kv-dtype", default="", help="comma list of our KV element types (EngineConfig.kv_dtype: "
                        "float32, float16, bfloat16, int8; empty: the model's dtype); each configuration runs once per type")
    parser.add_argument("--llama-kv", default="f16", help="comma list of llama.cpp's KV cache types (llama-bench -ctk / "
                        "-ctv; q8_0 with -fa on); our int8 KV rows compare with its q8_0 row where there is one")
    parser.add_argument("--llama-variant", default="", help="llama.cpp tools variant (avx2: the AVX2-only build)")
    parser.add_argument("--llama-format", default="q4_0", help="the model's file llama.cpp runs (q4_0: its best "
                        "4-bit format here; q4_k_m / q5_k_m: that K-quant file, against our row of the same name)")
    parser.add_argument("--rounds", type=int, default=1, help="run every row this many times, ours and llama.cpp "
                        "alternating; the table gives median speeds and the median of each round's ratio (this "
                        "machine's speed drifts by 15-40 %% between processes minutes apart)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.depths, args.decode_tokens, args.prefill_tokens = "default", "0,32", 4, 32
        args.repeats = args.llama_repeats = 1
    args.depth_list = [int(d) for d in args.depths.split(",")]
    if args.child:
        print(json.dumps(measure_ours(args)))
        return
    out = args.out or (Path(tempfile.gettempdir()) / "native_steps_smoke.json" if args.smoke
                       else Path("benchmarks/results/native_steps.json"))
    rows = []
    for round_ in range(args.rounds):
        for model in args.model.split(","):
            if args.side in ("both", "ours"):
                wanted = [c for c in args.config.split(",") if c]
                named = [c for c in CONFIGS[model] if c in wanted or f"{model}:{c}" in wanted]
                for config in named or [c for c in CONFIGS[model] if not wanted and (model, c) not in NAMED_ONLY]:
                    for isa in args.isa.split(","):
                        for kv_dtype in args.kv_dtype.split(","):
                            rows.append({**run_ours(model, config, args, isa, kv_dtype), "round": round_})
                            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            if args.side in ("both", "llama"):
                for kv in args.llama_kv.split(","):
                    rows.append({**run_llama(model, args, kv), "round": round_})
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "child", "depth_list")}
    settings.update(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), load_average=os.getloadavg(),
                    omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"), cpu_count=os.cpu_count())
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "native_steps", "settings": settings, "rows": rows}, indent=1))
    print(table(rows, args.depth_list))


if __name__ == "__main__":
    main()
