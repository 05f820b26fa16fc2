"""AWQ layer streaming vs fully resident: decode speed, bus bound, prefetch hits, peak memory.

Each configuration runs in its own process so peak RSS is its own:

    python -m benchmarks.micro.awq_streaming --awq DIR [--resident 2] [--tokens 48] [--repeats 3] [--out FILE]

With no --awq, the default model is quantized once by our producer (kvboost_tools.awq.quantize)
into the kvboost cache dir. Greedy decoding, no KV reuse (cache_bytes=0), torch threads = 2.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .._common import drop_page_cache

PROMPT = "Explain in a few sentences why reading weights from memory bounds the speed of decoding."


def default_awq_dir() -> Path:
    from kvboost_engine.paths import cache_home
    target = cache_home() / "models" / "SmolLM2-135M-Instruct-awq-g64"
    if not (target / "model.safetensors").exists():
        from kvboost_tools.awq.quantize import main as quantize
        quantize(["--out", str(target), "--group-size", "64"])
    return target


def run_one(awq: str, resident: int | None, tokens: int, repeats: int, stream_from: str) -> dict:
    """In a child process: load, warm up, time greedy decode; report speed, memory, telemetry."""
    import torch
    torch.set_num_threads(2)
    from kvboost_engine import Engine
    from kvboost_engine.weights.memory import peak_rss_bytes
    from kvboost_engine.weights.tiers import PackFileTier

    engine = Engine.from_pretrained(awq, cache_bytes=0, resident_layers=resident,
                                    stream_from=stream_from if resident is not None else None)
    loaded_peak, loaded_rss = peak_rss_bytes(), current_rss_bytes()
    engine.generate(PROMPT, max_new_tokens=4, min_new_tokens=4)          # warm-up (and first prefetch cycle)
    streamer = getattr(engine.model, "kvboost_streamer", None)
    if streamer is not None:
        streamer.reset_stats()
    rates, ids = [], None
    for _ in range(repeats):
        gen = engine.generate(PROMPT, max_new_tokens=tokens, min_new_tokens=tokens)
        rates.append((len(gen.token_ids) - 1) / (gen.total_s - gen.ttft_s))
        ids = gen.token_ids
    out = {"resident_layers": resident, "decode_tok_s": statistics.median(rates), "decode_tok_s_all": rates,
           "token_ids": ids, "rss_after_load": loaded_rss,
           "peak_rss_after_load": loaded_peak, "peak_rss_bytes": peak_rss_bytes(),
           "stats": {k: v for k, v in engine.stats().items() if k.startswith(("stream", "prefetch", "awq", "resident",
                                                                               "streamed", "dense", "staging"))}}
    if streamer is not None and isinstance(streamer.tier, PackFileTier):
        staging = torch.empty(streamer.slots[0].buffer.numel(), dtype=torch.uint8)
        out["tier_read_bytes_s_warm"] = statistics.median(
            measure_read_bandwidth(streamer.tier, streamer.order, staging) for _ in range(3))
        out["tier_read_bytes_s_cold"] = measure_read_bandwidth(streamer.tier, streamer.order, staging, cold=True)
    return out


def measure_read_bandwidth(tier, layers: list[int], staging, *, cold: bool = False) -> float:
    """Bytes per second bringing the given layers' blobs from `tier` into `staging`, once each."""
    from kvboost_engine.weights.tiers import fill
    if cold:
        drop_page_cache(tier.path)
    started = time.perf_counter()
    total = sum(fill(tier, layer, staging).numel() for layer in layers)
    return total / max(time.perf_counter() - started, 1e-9)


def current_rss_bytes() -> int:
    """Resident set size now (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def baseline_rss(awq: str) -> dict:
    """Peak RSS of a process that does everything a load does except holding weights: imports,
    tokenizer, config, the CPU int4 kernel probe, the model skeleton on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from kvboost_engine.weights.awq.kernels import select_layout
    from kvboost_engine.weights.memory import peak_rss_bytes, release_free_memory
    torch.set_num_threads(2)
    AutoTokenizer.from_pretrained(awq)
    config = AutoConfig.from_pretrained(awq)
    plain = config.__class__.from_dict({k: v for k, v in config.to_dict().items() if k != "quantization_config"})
    select_layout(torch.device("cpu"))
    with torch.device("meta"):
        AutoModelForCausalLM.from_config(plain)
    torch.ones(4, 4) @ torch.ones(4, 4)
    release_free_memory()
    return {"peak_rss_bytes": peak_rss_bytes(), "rss_after_trim": current_rss_bytes()}


def child(args: list[str]) -> dict:
    result = subprocess.run([sys.executable, "-m", "benchmarks.micro.awq_streaming", *args],
                            capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def summarise(awq: str, resident: dict, streaming: dict, base: dict) -> dict:
    s = streaming["stats"]
    decode_steps = max(1, s["stream_passes"])
    bytes_per_token = s["stream_bytes"] / decode_steps
    layer_bytes = s["resident_layer_bytes"] + s["streamed_layer_bytes"]
    overhead = base["peak_rss_bytes"] + s["dense_weight_bytes"]
    return {
        "model": awq, "machine": f"{os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f} at the end; torch threads 2; "
                   "fp32 activations",
        "identical_greedy_tokens": resident["token_ids"] == streaming["token_ids"],
        "resident_tok_s": resident["decode_tok_s"], "streaming_tok_s": streaming["decode_tok_s"],
        "streaming_over_resident": streaming["decode_tok_s"] / resident["decode_tok_s"],
        "streamed_bytes_per_token": bytes_per_token,
        "tier_read_GB_s_warm": streaming.get("tier_read_bytes_s_warm", 0) / 1e9,
        "tier_read_GB_s_cold": streaming.get("tier_read_bytes_s_cold", 0) / 1e9,
        "bus_bound_tok_s_warm": streaming.get("tier_read_bytes_s_warm", 0) / bytes_per_token,
        "bus_bound_tok_s_cold": streaming.get("tier_read_bytes_s_cold", 0) / bytes_per_token,
        "prefetch_hit_rate": s["prefetch_hit_rate"],
        "weights_resident_run_bytes": layer_bytes + s["dense_weight_bytes"], "layer_weight_bytes": layer_bytes,
        "dense_weight_bytes": s["dense_weight_bytes"], "baseline_process_rss": base["peak_rss_bytes"],
        "baseline_process_rss_after_trim": base["rss_after_trim"],
        "streaming_peak_above_trimmed_baseline_and_dense": streaming["peak_rss_bytes"] - base["rss_after_trim"]
        - s["dense_weight_bytes"],
        "fixed_overhead_bytes": overhead,
        "fixed_overhead_is": "peak RSS of a process with everything but weights (imports, tokenizer, config, "
                             "int4 kernel probe, meta-device skeleton) + the non-layer weights (embedding/lm_head, "
                             "norms) in the compute dtype",
        "peak_rss_resident": resident["peak_rss_bytes"], "peak_rss_streaming": streaming["peak_rss_bytes"],
        "streaming_rss_above_overhead": streaming["peak_rss_bytes"] - overhead,
        "memory_bound_0.4_of_weights_plus_overhead": 0.4 * (layer_bytes + s["dense_weight_bytes"]) + overhead,
        "memory_bound_met": streaming["peak_rss_bytes"] <= 0.4 * (layer_bytes + s["dense_weight_bytes"]) + overhead,
        "rss_after_load_resident": resident["rss_after_load"], "rss_after_load_streaming": streaming["rss_after_load"],
        "resident": resident, "streaming": streaming,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--awq", default=None)
    parser.add_argument("--resident", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stream-from", default="disk")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", choices=["resident", "streaming", "baseline"], default=None)
    args = parser.parse_args()
    if args.child == "baseline":
        print(json.dumps(baseline_rss(args.awq)))
        return
    if args.child:
        resident = None if args.child == "resident" else args.resident
        print(json.dumps(run_one(args.awq, resident, args.tokens, args.repeats, args.stream_from)))
        return
    awq = args.awq or str(default_awq_dir())
    common = ["--awq", awq, "--tokens", str(args.tokens), "--repeats", str(args.repeats),
              "--resident", str(args.resident), "--stream-from", args.stream_from]
    started = time.perf_counter()
    report = summarise(awq, child(common + ["--child", "resident"]), child(common + ["--child", "streaming"]),
                       child(["--child", "baseline", "--awq", awq]))
    report["wall_s"] = time.perf_counter() - started
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
