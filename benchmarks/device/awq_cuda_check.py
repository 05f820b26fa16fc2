"""One prepared device check: AWQ streaming on CUDA (pinned staging, copy stream) vs resident.

Builds a small random Llama, writes it as an AWQ checkpoint with our producer, then greedy
decodes with all layers resident and with 2 resident layers streamed from disk and from
pinned RAM; prints token identity, tok/s, prefetch hits and peak device memory as JSON.

    python -m benchmarks.device.awq_cuda_check --tokenizer DIR [--device cuda] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

import torch

PROMPT = "Streaming layers over the bus"


def build_checkpoint(out: Path, tokenizer_dir: Path, hidden: int, layers: int) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvboost_tools.awq.quantize import quantize_model, save_checkpoint
    config = AutoConfig.for_model("llama", hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                                  num_attention_heads=16, num_key_value_heads=4, vocab_size=49152,
                                  max_position_embeddings=4096, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    save_checkpoint(model, quantize_model(model, None, 128), out, 128, tokenizer_dir)


def decode(path: Path, device: str, tokens: int, **options) -> dict:
    from kvboost_engine import Engine
    engine = Engine.from_pretrained(path, device=device, dtype="float16", cache_bytes=0, **options)
    engine.generate(PROMPT, max_new_tokens=4, min_new_tokens=4)
    streamer = getattr(engine.model, "kvboost_streamer", None)
    if streamer is not None:
        streamer.reset_stats()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    rates, ids = [], None
    for _ in range(3):
        gen = engine.generate(PROMPT, max_new_tokens=tokens, min_new_tokens=tokens)
        rates.append((len(gen.token_ids) - 1) / (gen.total_s - gen.ttft_s))
        ids = gen.token_ids
    stats = engine.stats()
    keep = ("awq_kernel", "streamed_layers", "stream_bytes_per_pass", "prefetch_hit_rate", "stream_wait_s",
            "staging_bytes", "stream_tier", "resident_layer_bytes", "streamed_layer_bytes")
    out = {"tok_s": statistics.median(rates), "token_ids": ids, **{k: stats.get(k) for k in keep}}
    if device == "cuda":
        out["peak_device_bytes"] = torch.cuda.max_memory_allocated()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["KVBOOST_HOME"] = tmp
        path = Path(tmp) / "awq"
        build_checkpoint(path, args.tokenizer, args.hidden, args.layers)
        report = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                  "torch": torch.__version__}
        report["resident"] = decode(path, args.device, args.tokens)
        for tier in ("disk", "ram"):
            run = decode(path, args.device, args.tokens, resident_layers=2, stream_from=tier)
            run["identical_to_resident"] = run["token_ids"] == report["resident"]["token_ids"]
            report[f"stream_{tier}"] = run
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
