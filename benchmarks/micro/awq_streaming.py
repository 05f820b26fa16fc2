"""AWQ layer streaming vs fully resident: decode speed, bus bound, prefetch hits, peak memory; and
the native step's kernel (the CPU default where it runs, every layer resident) against them.

Each configuration runs in its own process so peak RSS is its own:

    python -m benchmarks.micro.awq_streaming --awq DIR [--resident 2] [--tokens 48] [--repeats 3] [--out FILE]
    python -m benchmarks.micro.awq_streaming --awq 1.7b --resident 4 --tokens 16 --repeats 2

With no --awq, the default model is quantized once by our producer (kvboost_tools.awq.quantize)
into the kvboost cache dir; `--awq 1.7b` writes random AWQ tensors (groups of 128) over the dense
weights of the random SmolLM2-1.7B-shape model (benchmarks/gguf_models.py; speed and memory do not
depend on the values). Resident and streaming run `--kernel` (cpu-int4pack: streaming cannot run
the native step), "native" the native step with every layer resident. Each reports decode tok/s
(greedy, no KV reuse: cache_bytes=0) and the prefill of a 512-token prompt; torch threads = 2.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
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


def random_awq_dir(group: int = 128) -> Path:
    """An AWQ checkpoint with random codes, zeros and scales (weights of std ~0.02, as the random
    model's) over the random 1.7B-shape model's dense tensors, config and tokenizer; written once."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from ..gguf_models import bench_dir, random_hf
    source = random_hf("1.7b")
    target = bench_dir("smollm2-1.7b-random") / f"awq-g{group}"
    if (target / "model.safetensors").exists():
        return target
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                     "version": "gemm", "modules_to_not_convert": None}
    gen, tensors = torch.Generator().manual_seed(0), {}
    with safe_open(source / "model.safetensors", "pt") as f:
        for name in f.keys():
            if not (name.endswith("_proj.weight") and ".layers." in name):
                tensors[name] = f.get_tensor(name).half()
                continue
            n, k = f.get_slice(name).get_shape()
            prefix = name.removesuffix(".weight")
            tensors[f"{prefix}.qweight"] = torch.randint(-2**31, 2**31 - 1, (k, n // 8), generator=gen, dtype=torch.int64).int()
            tensors[f"{prefix}.qzeros"] = torch.full((k // group, n // 8), 0x77777777, dtype=torch.int32)   # zero 7
            tensors[f"{prefix}.scales"] = torch.full((k // group, n), 0.005, dtype=torch.float16)
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    save_file(tensors, staging / "model.safetensors", metadata={"format": "pt"})
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    for file in source.iterdir():
        if file.suffix in (".json", ".jinja") and file.name != "config.json":
            shutil.copyfile(file, staging / file.name)
    os.replace(staging, target)
    return target


def run_one(awq: str, resident: int | None, tokens: int, repeats: int, stream_from: str, kernel: str | None) -> dict:
    """In a child process: load, warm up, time greedy decode and a 512-token prefill; report speed,
    memory, telemetry."""
    import torch
    torch.set_num_threads(2)
    from kvboost_engine import Engine
    from kvboost_engine.weights.memory import peak_rss_bytes
    from kvboost_engine.weights.tiers import PackFileTier
    from kvboost_tools.awq.texts import evaluation_text

    engine = Engine.from_pretrained(awq, cache_bytes=0, resident_layers=resident, awq_kernel=kernel,
                                    stream_from=stream_from if resident is not None else None)
    loaded_peak, loaded_rss = peak_rss_bytes(), current_rss_bytes()
    long_prompt = engine.tokenizer.decode(engine.tokenizer(evaluation_text())["input_ids"][:512])
    engine.generate(PROMPT, max_new_tokens=4, min_new_tokens=4)          # warm-up (and first prefetch cycle)
    streamer = getattr(engine.model, "kvboost_streamer", None)
    if streamer is not None:
        streamer.reset_stats()
    rates, ids = [], None
    for _ in range(repeats):
        gen = engine.generate(PROMPT, max_new_tokens=tokens, min_new_tokens=tokens)
        rates.append((len(gen.token_ids) - 1) / (gen.total_s - gen.ttft_s))
        ids = gen.token_ids
    prefills = [engine.generate(long_prompt, max_new_tokens=1) for _ in range(max(1, repeats - 1))]
    out = {"resident_layers": resident, "decode_tok_s": statistics.median(rates), "decode_tok_s_all": rates,
           "prefill_tokens": prefills[0].prompt_tokens,
           "prefill_tok_s": statistics.median(g.prompt_tokens / g.ttft_s for g in prefills),
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


def summarise(awq: str, resident: dict, streaming: dict, base: dict, native: dict | None) -> dict:
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
        "native": native,
        "native_over_resident_decode": native and native["decode_tok_s"] / resident["decode_tok_s"],
        "native_over_resident_prefill": native and native["prefill_tok_s"] / resident["prefill_tok_s"],
        "native_peak_rss_over_resident": native and native["peak_rss_bytes"] / resident["peak_rss_bytes"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--awq", default=None)
    parser.add_argument("--resident", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stream-from", default="disk")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--kernel", default="cpu-int4pack", help="the resident and streaming runs' awq_kernel")
    parser.add_argument("--child", choices=["resident", "streaming", "native", "baseline"], default=None)
    args = parser.parse_args()
    if args.child == "baseline":
        print(json.dumps(baseline_rss(args.awq)))
        return
    if args.child:
        resident = args.resident if args.child == "streaming" else None
        kernel = "native" if args.child == "native" else args.kernel
        print(json.dumps(run_one(args.awq, resident, args.tokens, args.repeats, args.stream_from, kernel)))
        return
    awq = str(random_awq_dir()) if args.awq == "1.7b" else args.awq or str(default_awq_dir())
    common = ["--awq", awq, "--tokens", str(args.tokens), "--repeats", str(args.repeats),
              "--resident", str(args.resident), "--stream-from", args.stream_from, "--kernel", args.kernel]
    from kvboost_engine.native import build
    started = time.perf_counter()
    native = child(common + ["--child", "native"]) if build.runs_here() else None
    report = summarise(awq, child(common + ["--child", "resident"]), child(common + ["--child", "streaming"]),
                       child(["--child", "baseline", "--awq", awq]), native)
    report["wall_s"] = time.perf_counter() - started
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
