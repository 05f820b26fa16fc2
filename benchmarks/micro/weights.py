"""CPU weight formats (`weights=`): speed, quality and memory of fp32, bf16, int8 and int4, and llama.cpp.

Each format runs in its own fresh process (so peak RSS is its own), after a first process has
converted and cached its weights (the conversion is not timed; its time is reported). Per format:

  decode_tok_s   engine.generate, greedy, `--decode-tokens` new tokens (EOS not allowed to stop it):
                 (tokens - 1) / (time after the first token), median of `--repeats`
  prefill_tok_s  a `--prefill-tokens` prompt (evaluation text) run cold (cache_bytes=0) / its TTFT
  ttft_s         a short chat turn, cold
  ppl_1k/ppl_2k  perplexity of the evaluation text (kvboost_tools.awq.quality) in windows of 1024
                 and 2048 tokens over the first `--ppl-tokens` tokens; delta vs fp32 in the table
                 (these forwards run many tokens at once: the prefill path, never the decode step)
  ppl_decode     perplexity of the first `--decode-ppl-tokens` tokens of the evaluation text
                 computed one token at a time through the decode step the engine uses (native
                 or PyTorch), so the decode step's own arithmetic is measured too
  native_decode  whether the engine took the native decode step (kvboost_engine/native)
  peak_rss       VmHWM after the runs; rss_after_load

llama.cpp (llama-cpp-python, the Q4_1 GGUF the default model comes from, same threads) decodes the
same kind of prompt in its own process, when llama_cpp is importable.

The fp32 bandwidth bound: read bandwidth measured here (a large fp32 matrix-vector product and a
sum over 1 GiB, medians), bound = bytes of weights read per decode step / bandwidth; the report
gives measured step time vs the bound (ratio = bound time / step time; 1.0 = at the limit).

Set OMP_WAIT_POLICY=PASSIVE on a busy machine (recorded in the environment).

Run: OMP_WAIT_POLICY=PASSIVE python -m benchmarks.micro.weights [--threads 2 --repeats 3 \
       --decode-tokens 64 --prefill-tokens 1024 --ppl-tokens 2048 --out benchmarks/results/weights.json]
KV element type (kv_dtype), its effect on the decode step's perplexity over a long context:
  python -m benchmarks.micro.weights --formats fp32,fp32-f16kv,fp32-bf16kv,fp32-int8kv,int4,int4-f16kv,int4-int8kv \
      --no-llama --decode-ppl-tokens 2048 --out benchmarks/results/weights_kv_dtype.json
Smoke: python -m benchmarks.micro.weights --formats fp32,int4 --decode-tokens 4 --prefill-tokens 64 \
       --ppl-tokens 128 --decode-ppl-tokens 16 --repeats 1 --no-llama --out /tmp/weights-smoke.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from .._common import median_time

# "-torch": native_decode=False (the PyTorch layer loop where the default takes the native step);
# "-f16kv" / "-bf16kv" / "-int8kv" (not in the default list): KV kept in float16 / bfloat16 / int8 (kv_dtype), which only
# ppl_decode and the speeds see (ppl_1k / ppl_2k run the model's own forward)
FORMATS = ("fp32", "fp32-torch", "bf16", "int8", "int4", "int4-torch")
STORY = [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]
SHORT = [{"role": "user", "content": "What is the capital of France?"}]


def _vm_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _median(fn, repeats: int):
    fn()                                                        # warm-up, excluded
    return statistics.median(fn() for _ in range(repeats))


def measure_format(fmt: str, args) -> dict:
    """One format in this (fresh) process."""
    from kvboost_engine import Engine
    from kvboost_tools.awq.quality import perplexity
    from kvboost_tools.awq.texts import evaluation_text
    base, _, variant = fmt.partition("-")
    native = {"native": True, "torch": False}.get(variant)
    kv = {"f16kv": {"kv_dtype": "float16"}, "bf16kv": {"kv_dtype": "bfloat16"}, "int8kv": {"kv_dtype": "int8"}}.get(variant, {})
    started = time.perf_counter()
    engine = Engine.from_pretrained(weights=None if base == "fp32" else base, cache_bytes=0, native_decode=native, **kv)
    load_s, rss_load = time.perf_counter() - started, _vm_kib("VmRSS") * 1024
    model, tokenizer = engine.model, engine.tokenizer
    prompt = tokenizer(evaluation_text())["input_ids"][:args.prefill_tokens]

    def decode():
        g = engine.chat(STORY, max_new_tokens=args.decode_tokens, min_new_tokens=args.decode_tokens)
        return (len(g.token_ids) - 1) / max(g.total_s - g.ttft_s, 1e-9)

    def prefill():
        return engine.generate(tokenizer.decode(prompt), max_new_tokens=1).ttft_s

    prefill_s = _median(prefill, args.repeats)
    out = {"format": fmt, "load_s": load_s, "decode_tok_s": _median(decode, args.repeats),
           "prefill_tokens": len(prompt), "prefill_s": prefill_s, "prefill_tok_s": len(prompt) / prefill_s,
           "ttft_s": _median(lambda: engine.chat(SHORT, max_new_tokens=1).ttft_s, args.repeats),
           "ppl_1k": perplexity(model, tokenizer, window=1024, max_tokens=args.ppl_tokens),
           "ppl_2k": perplexity(model, tokenizer, window=2048, max_tokens=args.ppl_tokens),
           "ppl_decode": decode_perplexity(engine, tokenizer(evaluation_text())["input_ids"][:args.decode_ppl_tokens]),
           "native_decode": engine.stats()["native_decode"],
           "weights_bytes": engine.stats().get("weights_bytes", _param_bytes(model)),
           "decode_bytes": _decode_bytes(model), "rss_after_load_bytes": rss_load,
           "peak_rss_bytes": _vm_kib("VmHWM") * 1024}
    out.update({k: v for k, v in engine.stats().items() if k in ("weights_from_cache", "weights_convert_s")})
    engine.close()
    return out


def decode_perplexity(engine, tokens: list[int]) -> float:
    """Perplexity of `tokens` fed one at a time through the engine's decode step (the native step
    when the engine takes it), each predicting the next."""
    from kvboost_engine.kv.contiguous import SequenceKV
    from kvboost_engine.model.forward import Forward
    from kvboost_engine.native.decoder import native_decoder
    adapter = engine.adapter
    fast = native_decoder(adapter)[0] if engine.stats()["native_decode"] else None
    forward, kv = Forward(adapter, fast), SequenceKV(adapter.geometry, len(tokens), adapter.device)
    total = 0.0
    with torch.inference_mode():
        for position, (token, following) in enumerate(zip(tokens, tokens[1:])):
            logits = forward(kv, [token], position)
            total -= float(torch.log_softmax(logits.float(), dim=-1)[following])
    return float(torch.exp(torch.tensor(total / (len(tokens) - 1))))


def _param_bytes(model) -> int:
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def _decode_bytes(model) -> int:
    """Weight bytes one decode step reads: everything but the embedding (one row of it), unless
    the embedding is the head's own matrix (then the head reads it in full)."""
    embedding = model.model.embed_tokens
    shared = {t.data_ptr() for t in embedding.buffers()} | {t.data_ptr() for t in embedding.parameters()}
    head = {t.data_ptr() for t in model.lm_head.buffers()} | {t.data_ptr() for t in model.lm_head.parameters()}
    own = sum(t.numel() * t.element_size() for t in list(embedding.parameters()) + list(embedding.buffers())
              if t.data_ptr() in shared - head)
    return _param_bytes(model) - own


def measure_llama(args) -> dict:
    """llama.cpp decode tok/s on the Q4_1 GGUF, greedy, same threads."""
    from llama_cpp import Llama

    from kvboost_engine.loading import default_gguf_file
    llm = Llama(model_path=str(default_gguf_file()), n_ctx=4096, n_threads=args.threads,
                n_threads_batch=args.threads, n_batch=512, seed=0, verbose=False)

    def decode():
        llm.reset()
        times = []
        for _ in llm.create_chat_completion(STORY, max_tokens=args.decode_tokens, temperature=0.0, top_k=1,
                                            repeat_penalty=1.0, stream=True):
            times.append(time.perf_counter())
        n = len(times) - 2                                      # the first chunk carries only the role
        return n / (times[-1] - times[1]) if n > 0 else float("nan")

    import llama_cpp
    return {"format": "llama.cpp Q4_1", "version": llama_cpp.__version__, "decode_tok_s": _median(decode, args.repeats),
            "peak_rss_bytes": _vm_kib("VmHWM") * 1024}


def read_bandwidth(repeats: int = 5) -> dict:
    """Bytes/s of a 1 GiB fp32 matrix-vector product and of a 1 GiB sum (medians)."""
    matrix = torch.ones(65536, 4096)
    vector = torch.ones(4096)

    def timed(fn):
        return matrix.numel() * 4 / median_time(fn, repeats)
    return {"mv_bytes_per_s": timed(lambda: torch.mv(matrix, vector)), "sum_bytes_per_s": timed(matrix.sum)}


def child(args) -> dict:
    torch.set_num_threads(args.threads)
    return measure_llama(args) if args.child == "llama" else measure_format(args.child, args)


def run_child(name: str, args) -> dict:
    """`name` measured in a fresh process; a failure becomes a row with its reason."""
    cmd = [sys.executable, "-m", "benchmarks.micro.weights", "--child", name, "--threads", str(args.threads),
           "--repeats", str(args.repeats), "--decode-tokens", str(args.decode_tokens),
           "--prefill-tokens", str(args.prefill_tokens), "--ppl-tokens", str(args.ppl_tokens),
           "--decode-ppl-tokens", str(args.decode_ppl_tokens)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        return {"format": name, "status": "failed: " + " | ".join(done.stderr.strip().splitlines()[-2:])[-300:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def convert_all(formats) -> dict:
    """Convert (and cache) each format once, untimed by the measuring processes; seconds each."""
    from kvboost_engine import Engine
    spent = {}
    for fmt in sorted({f.partition("-")[0] for f in formats}):
        if fmt != "fp32":
            engine = Engine.from_pretrained(weights=fmt, cache_bytes=0, native_decode=False)
            spent[fmt] = engine.stats()["weights_convert_s"]
            engine.close()
    return spent


def table(result: dict) -> str:
    rows = {r["format"]: r for r in result["rows"]}
    base = rows.get("fp32", {})
    lines = ["| format | decode step | decode tok/s | prefill tok/s | TTFT ms | ppl 1k (vs fp32) | ppl 2k (vs fp32) | "
             "ppl decode path (vs fp32) | weights MB | peak RSS MB |", "|---|---|---|---|---|---|---|---|---|---|"]

    def delta(r, key):
        if key not in r:
            return "-"
        rel = f" ({100 * (r[key] / base[key] - 1):+.2f}%)" if key in base else ""
        return f"{r[key]:.3f}{rel}"
    for r in result["rows"]:
        if "status" in r:
            lines.append(f"| {r['format']} | {r['status']} |||||||||")
            continue
        fmt = lambda key, scale=1.0, spec=".1f": f"{r[key] * scale:{spec}}" if key in r else "-"  # noqa: E731
        step = "-" if "native_decode" not in r else ("native" if r["native_decode"] else "PyTorch")
        lines.append(f"| {r['format']} | {step} | {fmt('decode_tok_s')} | {fmt('prefill_tok_s')} | "
                     f"{fmt('ttft_s', 1e3, '.0f')} | {delta(r, 'ppl_1k')} | {delta(r, 'ppl_2k')} | {delta(r, 'ppl_decode')} | "
                     f"{fmt('weights_bytes', 1e-6, '.0f')} | {fmt('peak_rss_bytes', 1e-6, '.0f')} |")
    for name, bound in result.get("bounds", {}).items():
        lines.append(f"\n{name} decode bound: {bound['decode_bytes'] / 1e6:.0f} MB read per step / "
                     f"{bound['bytes_per_s'] / 1e9:.2f} GB/s (matrix-vector read bandwidth) = {bound['bound_s'] * 1e3:.1f} ms;"
                     f" measured step {bound['step_s'] * 1e3:.1f} ms: {100 * bound['ratio']:.0f}% of the bound")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--prefill-tokens", type=int, default=1024)
    parser.add_argument("--ppl-tokens", type=int, default=2048)
    parser.add_argument("--decode-ppl-tokens", type=int, default=512)
    parser.add_argument("--no-llama", action="store_true", help="skip llama.cpp")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/weights.json"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return
    from .._common import environment, load_default
    torch.set_num_threads(args.threads)
    formats = [f for f in args.formats.split(",") if f]
    converted = convert_all(formats)
    bandwidth = read_bandwidth()
    rows = [run_child(fmt, args) for fmt in formats] + ([] if args.no_llama else [run_child("llama", args)])
    model, _ = load_default()
    result = {"benchmark": "weights", "settings": {k: v for k, v in vars(args).items() if k not in ("out", "child")},
              "environment": environment(model), "convert_s": converted, "bandwidth": bandwidth, "rows": rows}
    result["bounds"] = {}
    for r in rows:
        if r.get("format", "").startswith("fp32") and "decode_tok_s" in r:
            bound_s = r["decode_bytes"] / bandwidth["mv_bytes_per_s"]
            step_s = 1 / r["decode_tok_s"]
            result["bounds"][r["format"]] = {"decode_bytes": r["decode_bytes"], "bytes_per_s": bandwidth["mv_bytes_per_s"],
                                             "bound_s": bound_s, "step_s": step_s, "ratio": bound_s / step_s}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(table(result))


if __name__ == "__main__":
    main()
