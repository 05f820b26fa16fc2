"""Bring your GGUF (#28): our engine against llama.cpp's llama-bench on the same file, per model and format.

Models and formats (files built once by benchmarks/gguf_models.py with llama.cpp's own tools):
  default  SmolLM2-135M-Instruct: q4_1 (as shipped, Q8_0 embedding), q4_0 (llama-quantize requant), hf-int4
  gemma3   Gemma 3 270M base: q4_k_m (as shipped; loads as float32 by default, the native step does not
           run Gemma), q4_k_m:stored (the same file with weights="gguf"), q4_0, q4_1 (requants), hf-int4
  1.7b     random weights, SmolLM2-1.7B's config: q4_0, q4_1, q4_k_m, q8_0 (from a BF16 GGUF), hf-int4
hf-int4 is the model's HF directory loaded with weights="int4" (its ratios in the table are against
llama.cpp on the model's Q4_0 GGUF); the other formats give the .gguf path to Engine.from_pretrained
as it is.

Ours, each in a fresh process with KVBOOST_HOME pointing at an empty temporary home (the compiled
native kernels linked in from the real one, so no compile is timed; the model file's pages dropped
from the page cache with posix_fadvise before the first process):
  first   load_s and peak RSS (VmHWM) of load + `--decode-tokens` new tokens, cache cold
  cached  a second process on the same home: load_s (what the first wrote is reused), then
          decode_tok_s  greedy, `--decode-tokens` new tokens after a short prompt (EOS cannot stop
                        it): (tokens - 1) / (time after the first token), median of `--repeats`
          peak_rss      VmHWM after load + the first decode (the acceptance figure), and after all runs
          prefill_tok_s a `--prefill-tokens` prompt (evaluation text), cache off, / its TTFT, median
llama.cpp (benchmarks/llama_tools.sh; same file, same threads):
          llama-bench -t T -p P -n N -r R -m FILE -o json: pp and tg tok/s (median of its R
          repetitions' samples_ts; all samples and its stddev kept),
          peak RSS (GNU time's %M of the process, mmap'd pages it touched included);
          load_s: llama-batched-bench's "load time" (llama_perf_context_print, -lv 4) for a
          1-token prompt, the file's pages dropped from the page cache first (first_load_s) and
          again right after (load_s; the process's wall time beside each: *process_s)

Run:   python -m benchmarks.micro.gguf --all [--side both|ours|llama]
       python -m benchmarks.micro.gguf --model 1.7b --format q4_0,hf-int4 --side ours
Smoke: python -m benchmarks.micro.gguf --model default --format q4_1 --decode-tokens 4 --prefill-tokens 32 --repeats 1
Results: benchmarks/results/gguf.json (rows merged by model, format and side); a table is printed.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..gguf_models import MODEL_FORMATS, NAMED_ONLY, STORED, home, model_file, tools_dir

PROMPT = "The lighthouse keeper looked out at the storm and"


def _vm_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def drop_page_cache(path: Path) -> None:
    """Evict the clean cached pages of `path` (a file, or every file under a directory)."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# ---- our engine, in a child process --------------------------------------------------------
def measure_ours(args) -> dict:
    import torch

    from kvboost_engine import Engine
    from kvboost_tools.awq.texts import evaluation_text
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    weights = "int4" if args.fmt == "hf-int4" else "gguf" if args.fmt.endswith(STORED) else None
    engine = Engine.from_pretrained(args.path, weights=weights, cache_bytes=0)
    out = {"load_s": time.perf_counter() - started, "rss_after_load_bytes": _vm_kib("VmRSS") * 1024}
    n = args.decode_tokens

    def decode():
        g = engine.generate(PROMPT, max_new_tokens=n, min_new_tokens=n)
        return (len(g.token_ids) - 1) / max(g.total_s - g.ttft_s, 1e-9)
    speeds = [decode()]
    out["peak_rss_bytes"] = _vm_kib("VmHWM") * 1024             # load + the first `n` new tokens
    if args.child == "first":
        out["decode_tok_s"] = speeds[0]
    else:
        speeds += [decode() for _ in range(args.repeats)]
        out["decode_tok_s"] = statistics.median(speeds[1:])     # the first one is a warm-up
        ids = engine.tokenizer(evaluation_text())["input_ids"][:args.prefill_tokens]
        text = engine.tokenizer.decode(ids)

        def prefill():
            g = engine.generate(text, max_new_tokens=1)
            return g.prompt_tokens, g.ttft_s
        runs = [prefill() for _ in range(args.repeats + 1)][1:]
        out["prefill_tokens"] = runs[0][0]
        out["prefill_tok_s"] = runs[0][0] / statistics.median(t for _, t in runs)
        out["peak_rss_all_bytes"] = _vm_kib("VmHWM") * 1024
    stats = engine.stats()
    out["native_decode"] = stats.get("native_decode")
    out["engine_stats"] = {k: v for k, v in stats.items() if "weight" in k or "mapped" in k or "resident" in k}
    engine.close()
    return out


def _child(kind: str, path: Path, fmt: str, args, env: dict) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.micro.gguf", "--child", kind, "--path", str(path), "--format", fmt,
           "--threads", str(args.threads), "--repeats", str(args.repeats),
           "--decode-tokens", str(args.decode_tokens), "--prefill-tokens", str(args.prefill_tokens)]
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        return {"status": f"failed ({done.returncode}): " + " | ".join(done.stderr.strip().splitlines()[-3:])[-400:]}
    out = json.loads(done.stdout.strip().splitlines()[-1])
    out["process_s"] = time.perf_counter() - started
    return out


def run_ours(model: str, fmt: str, path: Path, args) -> dict:
    real = home()
    temp = Path(tempfile.mkdtemp(prefix="gguf-bench-home-", dir=args.temp_dir or real))
    try:
        if (real / "native").is_dir():
            (temp / "native").symlink_to(real / "native")       # compiled kernels: not a model cache
        env = dict(os.environ, KVBOOST_HOME=str(temp), OMP_NUM_THREADS=str(args.threads))
        drop_page_cache(path)
        row = {"model": model, "format": fmt, "side": "ours", "file": str(path), "load_average": os.getloadavg()}
        first = {} if args.no_first else _child("first", path, fmt, args, env)
        if "status" in first:
            return {**row, "status": "first: " + first["status"]}
        cached = _child("cached", path, fmt, args, env)
        if "status" in cached:
            return {**row, "status": "cached: " + cached["status"]}
        written = sum(p.stat().st_size for p in temp.rglob("*") if p.is_file() and not p.is_symlink())
        row.update({f"first_{k}": v for k, v in first.items() if k in ("load_s", "peak_rss_bytes", "process_s")})
        row.update(cached)
        row["cache_written_bytes"] = written
        return row
    finally:
        shutil.rmtree(temp, ignore_errors=True)


# ---- llama.cpp -------------------------------------------------------------------------------
def anchor_env() -> dict[str, str]:
    """The environment llama.cpp's tools run in: ours without OMP_WAIT_POLICY (with PASSIVE, ggml's
    OpenMP threads sleep between its many barriers and its tools decode 2-3x slower on 2 cores: the
    anchor runs as a user runs it)."""
    return {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}


def _timed(cmd: list[str]) -> tuple[str, str, float, int]:
    """(stdout, stderr, seconds, peak RSS bytes) of a llama.cpp tool (in `anchor_env`), the peak from
    GNU time's %M (the command's own maximum resident set; ru_maxrss of a child forked from this
    process would include this process's RSS at the fork)."""
    with tempfile.TemporaryDirectory() as tmp:
        peak_file = Path(tmp) / "peak"
        started = time.perf_counter()
        done = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", str(peak_file), *cmd], capture_output=True, text=True,
                              env=anchor_env())
        seconds = time.perf_counter() - started
        if done.returncode != 0:
            raise RuntimeError(f"{Path(cmd[0]).name} exited {done.returncode}: {done.stderr.strip()[-400:]}")
        peak_kib = int(peak_file.read_text().split()[-1])
    return done.stdout, done.stderr, seconds, peak_kib * 1024


def llama_load(path: Path, args, tools: Path) -> tuple[float, float]:
    """(llama.cpp's own "load time", the process's wall seconds) of llama-batched-bench on a
    1-token prompt and 1 new token."""
    out, err, seconds, _ = _timed([str(tools / "bin" / "llama-batched-bench"), "-m", str(path), "-t", str(args.threads),
                                   "-c", "256", "-b", "64", "-ub", "64", "-npp", "1", "-ntg", "1", "-npl", "1", "-lv", "4"])
    found = re.search(r"load time\s*=\s*([\d.]+) ms", err + out)
    return (float(found.group(1)) / 1e3 if found else float("nan")), seconds


def run_llama(model: str, fmt: str, path: Path, args) -> dict:
    row = {"model": model, "format": fmt, "side": "llama.cpp", "file": str(path), "load_average": os.getloadavg()}
    tools = tools_dir(args.llama_variant)
    row["tools"] = str(tools)
    try:
        drop_page_cache(path)
        row["first_load_s"], row["first_process_s"] = llama_load(path, args, tools)
        row["load_s"], row["load_process_s"] = llama_load(path, args, tools)
        out, _, seconds, peak = _timed([str(tools / "bin" / "llama-bench"), "-t", str(args.threads),
                                        "-p", str(args.prefill_tokens), "-n", str(args.decode_tokens),
                                        "-r", str(args.llama_repeats), "-m", str(path), "-o", "json"])
    except RuntimeError as error:
        return {**row, "status": str(error)}
    tests = json.loads(out)
    for test in tests:
        key = "prefill_tok_s" if test["n_prompt"] else "decode_tok_s"
        samples = test.get("samples_ts") or [test["avg_ts"]]
        row[key], row[key.replace("tok_s", "stddev")] = statistics.median(samples), test["stddev_ts"]
        row[key.replace("tok_s", "samples")] = samples
    row.update({"peak_rss_bytes": peak, "bench_s": seconds, "model_type": tests[0].get("model_type"),
                "model_size": tests[0].get("model_size"), "build_commit": tests[0].get("build_commit"),
                "cpu_info": tests[0].get("cpu_info")})
    return row


# ---- report ----------------------------------------------------------------------------------
def table(rows: list[dict]) -> str:
    lines = ["| model | format | side | peak RSS MB (load+decode) | load s first / cached | decode tok/s | "
             "prefill tok/s | RSS / llama.cpp | cached load / llama.cpp | decode / llama.cpp | load avg |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    llama = {(r["model"], r["format"]): r for r in rows if r["side"] == "llama.cpp" and "status" not in r}

    def f(r, key, scale=1.0, spec=".1f"):
        return f"{r[key] * scale:{spec}}" if isinstance(r.get(key), (int, float)) else "-"
    for r in rows:
        if "status" in r:
            lines.append(f"| {r['model']} | {r['format']} | {r['side']} | {r['status'][:120]} ||||||||")
            continue
        ref = llama.get((r["model"], "q4_0" if r["format"] == "hf-int4" else r["format"].removesuffix(STORED)))
        ratio_rss = ratio_load = ratio_dec = "-"
        if ref and r["side"] == "ours":
            ratio_rss = f"{r['peak_rss_bytes'] / ref['peak_rss_bytes']:.2f}x"
            ratio_load = f"{r['load_s'] / ref['load_s']:.2f}x"
            ratio_dec = f"{r['decode_tok_s'] / ref['decode_tok_s']:.2f}x"
        lines.append(f"| {r['model']} | {r['format']} | {r['side']} | {f(r, 'peak_rss_bytes', 1e-6, '.0f')} | "
                     f"{f(r, 'first_load_s', 1, '.2f')} / {f(r, 'load_s', 1, '.2f')} | {f(r, 'decode_tok_s')} | "
                     f"{f(r, 'prefill_tok_s')} | {ratio_rss} | {ratio_load} | {ratio_dec} | {r.get('load_average', ['-'])[0]:.1f} |")
    return "\n".join(lines)


def merge(out: Path, rows: list[dict], settings: dict) -> dict:
    """Rows replace earlier rows of the same (model, format, side) in `out`."""
    result = json.loads(out.read_text()) if out.is_file() else {"benchmark": "gguf", "rows": []}
    keys = {(r["model"], r["format"], r["side"]) for r in rows}
    kept = [r for r in result["rows"] if (r["model"], r["format"], r["side"]) not in keys]
    order = {m: i for i, m in enumerate(MODEL_FORMATS)}
    result["rows"] = sorted(kept + rows, key=lambda r: (order.get(r["model"], 9), r["format"], r["side"]))
    result.setdefault("runs", []).append(settings)
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help=f"comma list of {', '.join(MODEL_FORMATS)}")
    parser.add_argument("--format", default="", help="comma list (default: every format of each model)")
    parser.add_argument("--all", action="store_true", help="every model and format (but the named-only llama3-8b)")
    parser.add_argument("--side", choices=("both", "ours", "llama"), default="both")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--llama-repeats", type=int, default=5, help="llama-bench -r")
    parser.add_argument("--no-first", action="store_true", help="skip our first-load process")
    parser.add_argument("--llama-variant", default="", help='"" (this CPU\'s ISAs) or "avx2"')
    parser.add_argument("--temp-dir", help="where the temporary kvboost homes go (default: the real home)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gguf.json"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        args.fmt = args.format
        print(json.dumps(measure_ours(args)))
        return
    models = [m for m in MODEL_FORMATS if m not in NAMED_ONLY] if args.all else args.model.split(",")
    rows = []
    for model in models:
        formats = [f for f in args.format.split(",") if f] if args.format and not args.all else MODEL_FORMATS[model]
        for fmt in formats:
            path = model_file(model, fmt)
            for side, run in (("ours", run_ours), ("llama", run_llama)):
                if args.side in ("both", side) and not (side == "llama" and (fmt == "hf-int4" or STORED in fmt)):
                    rows.append(run(model, fmt, path, args))
                    print(json.dumps(rows[-1]), file=sys.stderr)
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "child", "path")}
    settings.update(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), load_average=os.getloadavg(),
                    omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"),
                    cpu_count=os.cpu_count())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = merge(args.out, rows, settings)
    args.out.write_text(json.dumps(result, indent=1))
    run = {(r["model"], r["format"]) for r in rows}      # these rows, beside the stored rows of the other side
    print(table([r for r in result["rows"] if (r["model"], r["format"]) in run]))


if __name__ == "__main__":
    main()
