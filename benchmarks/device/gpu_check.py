"""One prepared check on a CUDA machine: the engine's GPU paths, exactness and speed.

Uses a random Llama-shaped model (no download) in bfloat16 on the GPU and the default
model's tokenizer (`--tokenizer DIR`). Prints one JSON object:
  exactness   cache on vs off (greedy, 4-turn chat): identical tokens; max |logit diff|
  paged       paged KV on CUDA (multi-run attention, manual LSE path) vs contiguous: identical tokens
  moved       blend with recompute_ratio=1.0 equals no cache; blend/none telemetry
  rope        RoPE re-rotation on CUDA tensors vs the model's rotary (max error)
  attention   which SDPA kernels torch reports, whether flash-attn is importable
  speed       TTFT cold vs warm at turn 4; decode tok/s of engine.chat vs model.generate
  kv_cpu      kv_device="cpu" (weights on the GPU, KV in pinned CPU pages): same tokens as KV on the
              GPU (chat replay and moved reuse), decode tok/s and GPU memory at a long context

    python -m benchmarks.device.gpu_check --tokenizer DIR [--out FILE] [--checks kv_cpu,speed,...]
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from kvboost_engine import Engine
from kvboost_engine.model.arch import ModelAdapter
from kvboost_engine.model.rope import RopeMover

QUESTIONS = ["Tell me about the first topic.", "And the second one?", "Compare them.", "Summarise briefly."]
SYSTEM = "You are a careful assistant that answers in detail about scientific instruments. " * 20


def build_model(device: str, small: bool = False):
    size = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2) if small else \
        dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=16)
    config = AutoConfig.for_model("llama", num_attention_heads=16 if not small else 4, num_key_value_heads=4 if not small else 2,
                                  vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True, **size)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()


def replay(engine: Engine, max_new_tokens: int = 16) -> list:
    messages = [{"role": "system", "content": SYSTEM}]
    out = []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        logits = engine.next_token_logits(messages=messages)
        g = engine.chat(messages, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens)
        out.append((g, logits))
        messages.append({"role": "assistant", "content": g.text})
    return out


def check_exactness(model, tokenizer) -> dict:
    warm, cold = replay(Engine(model, tokenizer)), replay(Engine(model, tokenizer, cache_bytes=0))
    return {"identical_tokens": all(w.token_ids == c.token_ids for (w, _), (c, _) in zip(warm, cold)),
            "max_logit_diff": max(float((lw - lc).abs().max()) for (_, lw), (_, lc) in zip(warm, cold)),
            "reused_per_turn": [w.reused_tokens for w, _ in warm], "prompt_per_turn": [w.prompt_tokens for w, _ in warm]}


def check_paged(model, tokenizer) -> dict:
    paged, contiguous = replay(Engine(model, tokenizer, paged=True)), replay(Engine(model, tokenizer, paged=False))
    return {"identical_tokens": all(p.token_ids == c.token_ids for (p, _), (c, _) in zip(paged, contiguous)),
            "max_logit_diff": max(float((lp - lc).abs().max()) for (_, lp), (_, lc) in zip(paged, contiguous))}


def check_moved(model, tokenizer) -> dict:
    docs = [f"Document {i}: " + " ".join(f"fact {i}.{j} is {i * j}." for j in range(30)) for i in range(5)]

    def messages(order):
        parts = [{"type": "document", "text": docs[i]} for i in order] + [{"type": "text", "text": "Which fact?"}]
        return [{"role": "user", "content": parts}]

    cold = Engine(model, tokenizer, cache_bytes=0)
    out = {}
    for name, options in {"full_ratio": dict(recompute_ratio=1.0), "blend": {}, "none": dict(moved_reuse="none")}.items():
        engine = Engine(model, tokenizer, **options)
        engine.chat(messages(range(5)), max_new_tokens=1)
        g = engine.chat(messages([3, 1, 4, 0, 2]), max_new_tokens=1)
        logits = engine.next_token_logits(messages=messages([3, 1, 4, 0, 2]))
        out[name] = {"reused_moved": g.reused_moved, "recomputed": g.recomputed, "prompt": g.prompt_tokens,
                     "max_logit_diff_vs_no_cache": float((logits - cold.next_token_logits(messages=messages([3, 1, 4, 0, 2]))).abs().max())}
    return out


def check_rope(model) -> dict:
    adapter = ModelAdapter(model)
    mover = RopeMover(adapter)
    keys = torch.randn(1, 4, 64, adapter.geometry.head_dim, device=model.device, dtype=torch.float32)
    apply = sys.modules[type(model).__module__].apply_rotary_pos_emb

    def at(start):
        cos, sin = model.model.rotary_emb(keys, torch.arange(start, start + 64, device=model.device)[None])
        return apply(keys, keys, cos.float(), sin.float())[1]

    moved = mover.move(at(10).clone(), 10, 5000)
    return {"max_abs_error": float((moved - at(5000)).abs().max())}


def check_attention() -> dict:
    try:
        import flash_attn  # noqa: F401
        flash = True
    except ImportError:
        flash = False
    b = torch.backends.cuda
    return {"flash_attn_importable": flash, "sdpa_flash": b.flash_sdp_enabled(), "sdpa_mem_efficient": b.mem_efficient_sdp_enabled(),
            "device": torch.cuda.get_device_name(0), "torch": torch.__version__}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeats=5):
    fn()
    _sync()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def warm_turn4(model, tokenizer, **options):
    """A fresh engine replays turns 1-3; returns (turn-4 messages, TTFT on first sight of turn 4)."""
    warm = Engine(model, tokenizer, **options)
    messages = [{"role": "system", "content": SYSTEM * 4}]
    for question in QUESTIONS[:3]:
        messages += [{"role": "user", "content": question}]
        reply = warm.chat(messages, max_new_tokens=16, min_new_tokens=16)
        messages += [{"role": "assistant", "content": reply.text}]
    messages += [{"role": "user", "content": QUESTIONS[3]}]
    return messages, warm.chat(messages, max_new_tokens=1).ttft_s


def check_speed(model, tokenizer) -> dict:
    cold = Engine(model, tokenizer, cache_bytes=0)
    samples = [warm_turn4(model, tokenizer) for _ in range(4)][1:]
    messages = samples[0][0]
    warm_ttft = statistics.median(t for _, t in samples)
    paged_ttft = statistics.median(warm_turn4(model, tokenizer, paged=True)[1] for _ in range(3))
    cold_ttft = statistics.median(cold.chat(messages, max_new_tokens=1).ttft_s for _ in range(5))
    ids = torch.tensor([cold.encode_messages(messages).token_ids], device=model.device)

    def hf(n):
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)

    hf_decode = timed(lambda: hf(128), 3) - timed(lambda: hf(1), 3)
    runs = [cold.chat(messages, max_new_tokens=128, min_new_tokens=128) for _ in range(4)][1:]
    ours = statistics.median(g.total_s - g.ttft_s for g in runs)
    return {"prompt_tokens": len(ids[0]), "cold_ttft_s": cold_ttft, "warm_ttft_s": warm_ttft, "warm_paged_ttft_s": paged_ttft,
            "transformers_decode_tok_s": 127 / hf_decode, "engine_decode_tok_s": 127 / ours}


def check_kv_cpu(model, tokenizer) -> dict:
    on_gpu, on_cpu = replay(Engine(model, tokenizer)), replay(Engine(model, tokenizer, kv_device="cpu"))
    engine = Engine(model, tokenizer, kv_device="cpu")
    out = {"pool_device": str(engine.cache.pool.ram.device), "pool_pinned": engine.cache.pool.ram.is_pinned(),
           "identical_tokens": all(a.token_ids == b.token_ids for (a, _), (b, _) in zip(on_gpu, on_cpu)),
           "max_logit_diff": max(float((la - lb).abs().max()) for (_, la), (_, lb) in zip(on_gpu, on_cpu)),
           "reused_per_turn": [b.reused_tokens for b, _ in on_cpu]}
    docs = [f"Document {i}: " + " ".join(f"fact {i}.{j} is {i * j}." for j in range(30)) for i in range(5)]

    def messages(order):
        parts = [{"type": "document", "text": docs[i]} for i in order] + [{"type": "text", "text": "Which fact?"}]
        return [{"role": "user", "content": parts}]

    moved = {}
    for name, options in {"gpu": {}, "cpu": {"kv_device": "cpu"}}.items():
        e = Engine(model, tokenizer, **options)
        e.chat(messages(range(5)), max_new_tokens=1)
        g = e.chat(messages([3, 1, 4, 0, 2]), max_new_tokens=8, min_new_tokens=8)
        moved[name] = (g.token_ids, g.reused_moved, g.recomputed)
    out["moved_identical_tokens"] = moved["gpu"][0] == moved["cpu"][0]
    out["moved_reused_recomputed"] = [moved["cpu"][1], moved["cpu"][2]]
    prompt = "Measure the instrument carefully. " * 900                    # about 6k tokens
    for name, options in {"gpu": {}, "cpu": {"kv_device": "cpu"}}.items():
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()                                 # weights (and nothing else)
        e = Engine(model, tokenizer, cache_bytes=0, **options)
        runs = [e.generate(prompt, max_new_tokens=64, min_new_tokens=64) for _ in range(2)]
        out[f"long_{name}"] = {"prompt_tokens": runs[-1].prompt_tokens, "ttft_s": runs[-1].ttft_s,
                               "decode_tok_s": 63 / (runs[-1].total_s - runs[-1].ttft_s),
                               "peak_gpu_bytes_over_weights": torch.cuda.max_memory_allocated() - base,
                               "tokens": runs[-1].token_ids[:8]}
        del e, runs
    out["long_identical_first_tokens"] = out["long_gpu"]["tokens"] == out["long_cpu"]["tokens"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="a tiny model (to try the script on a CPU)")
    parser.add_argument("--checks", default="exactness,paged,moved,rope,speed,kv_cpu")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    model = build_model(args.device, args.small)
    result = {"attention": check_attention() if args.device == "cuda" else {}}
    for name, fn in (("exactness", lambda: check_exactness(model, tokenizer)), ("paged", lambda: check_paged(model, tokenizer)),
                     ("moved", lambda: check_moved(model, tokenizer)), ("rope", lambda: check_rope(model)),
                     ("speed", lambda: check_speed(model, tokenizer)), ("kv_cpu", lambda: check_kv_cpu(model, tokenizer))):
        if name not in args.checks.split(","):
            continue
        try:
            result[name] = fn()
        except Exception as err:  # noqa: BLE001 - one failing check must not hide the others
            result[name] = {"error": f"{type(err).__name__}: {err}"}
        print(name, json.dumps(result[name]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
