"""Continuous batching: throughput and latency of concurrent chats, side by side with transformers'
own continuous batching and llama.cpp's llama-batched-bench, a short request during a long prefill,
and KV blocks at 16 concurrent.

Weights (--weights, a comma list; default fp32,int4): fp32 (the exact float32 default model), int4
(weights="int4"), and with --gguf PATH also that GGUF as stored ("gguf"). levels and unshared run for
each; transformers, prefill and memory once, on the first; llama once.

Sections:
  levels      1, 2, 4, 8, 16 concurrent chats (distinct questions over one ~1k-token system prompt,
              64 new tokens each, greedy, the system prompt warmed once): aggregate tokens/s (wall,
              and decode_tok_s: sequences / mean gap between tokens), p50/p99 per-token latency,
              speed-up over serial (the same chats one after another), greedy outputs identical to
              serial; the decode step at 1 row and at 8 (ForwardEvents) and the bound for a step of
              8 rows (weight-read time; fp32: also the weight products on 8 rows); then the speed-up
              at 8 again, each wave right after its own serial baseline, 3 times.
  unshared    8 concurrent chats with nothing shared: 8 different ~1k-token system prompts (each
              warmed, so both sides prefill only the question), each sequence reading its own KV:
              speed-up over serial, paired as above, greedy identical to serial, and the read bound
              (8 (W + K) / (W + 8 K): weights W read once per step, each sequence's KV K its own).
  llama       llama-batched-bench on the default model's Q4_0 GGUF (or --gguf): -c 4096 -b 512 -ub 512
              -npp 400 -ntg 48 -npl 1,8 -t 2, with -pps (the prompt shared) and without: speed_tg
              (decode tok/s, all sequences), speed_pp and speed (all tokens / all time) at 1 and 8;
              with --system-tokens N its prompt is N tokens (-npp N, -c 8 (N + 48)).
  transformers the same 8 chats through transformers' generate_batch (paged, block sharing on) vs
              ours: wall time, throughput and TTFT; then the same prompts again (a second wave).
  prefill     a short request arriving during a ~4k-token prefill: its TTFT vs the long prefill's.
  memory      pool blocks in use at 16 concurrent chats over the system prompt vs 16 copies of it.

A summary table (per weights: shared and unshared speed-up at 8, aggregate at 8, greedy = serial,
bounds; int4 at 8 against llama-batched-bench -npl 8) ends the output and the JSON.

Run alone on a quiet machine (about 12 minutes on 2 cores for the defaults), without OMP_WAIT_POLICY
(llama.cpp's tools always run without it: gguf.anchor_env):
  python -m benchmarks.micro.batching [--weights fp32,int4] [--gguf PATH]
      [--sections levels,unshared,transformers,prefill,memory,llama] [--out benchmarks/results/batching.json]
With float16 KV (EngineConfig.kv_dtype; llama.cpp keeps f16 KV by default), our sections only:
  python -m benchmarks.micro.batching --kv-dtype float16 --sections levels,unshared \
      --out benchmarks/results/batching_f16kv.json
At a real size (--gguf <a 1.7B-shape file>) 8 warmed ~1k-token prompts can outgrow the engine's default
2 GiB cache (SmolLM2-1.7B's 32 KV heads: ~0.4 GB of float32 KV each), and are then prefilled again inside
the timed waves; --cache-gib sizes every engine's cache_bytes for that:
  python -m benchmarks.micro.batching --weights "" --gguf <file> --cache-gib 6 --sections unshared \
      --out benchmarks/results/batching_1p7b_cache6g.json
8 such prompts of 4,000 tokens hold ~12.8 GB of float32 KV: past the default KV pool's cap of half the
memory on a 24 GB machine, so --kv-pool-gib sizes the pool past it (kv_pool_bytes):
  python -m benchmarks.micro.batching --weights "" --gguf <file> --system-tokens 4000 --cache-gib 14 \
      --kv-pool-gib 16 --sections unshared --out benchmarks/results/batching_1p7b_unshared_sys4000.json
Completion mode (--completion; a base model without a chat template, Gemma 3 270M): each chat is the
plain prompt "<system>\n\nQuestion: <question>\nAnswer:" through engine.stream / generate, the system
text warmed as a plain prefix; levels and unshared only:
  python -m benchmarks.micro.batching --weights "" --gguf <Gemma 3's Q4_0 GGUF> --completion \
      --sections levels,unshared,llama --out benchmarks/results/batching_gemma3.json
Another system prompt length (--system-tokens N; default 1000): attention's share of a step, and the
unshared read bound, move with it:
  python -m benchmarks.micro.batching --weights int4 --system-tokens 250 --sections levels,unshared \
      --out benchmarks/results/batching_int4_sys250.json
Smoke: python -m benchmarks.micro.batching --smoke --sections levels,unshared,llama
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import torch

from kvboost_engine import Engine, ForwardEvent

from .._common import environment, load_default
from .batching_report import (kv_bytes_per_token, linear_s, llama_batched, load_weights, step_read_bytes, summary,
                              summary_table, unshared_bound, weight_read_s)
from .paged import long_text

NEW_TOKENS = 64
SYSTEM_TOKENS = 1000
PAIRS = 3
ENGINE_OPTIONS: dict = {}                   # every engine's options (--kv-dtype)
COMPLETION = False                         # plain prompts, not chats (--completion)
QUESTIONS = [f"Question {i}: what does record {i * 7} say, and which hall is it from?" for i in range(16)]


def chats(system: str, n: int) -> list:
    return [one_chat(system, q) for q in QUESTIONS[:n]]


def one_chat(system: str, question: str):
    """Messages, or with --completion one plain prompt (a base model has no chat template)."""
    if COMPLETION:
        return f"{system}\n\nQuestion: {question}\nAnswer:"
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def system_part(system: str):
    """What engine.warm caches: the system message, or the plain prefix (--completion)."""
    return system if COMPLETION else [{"role": "system", "content": system}]


def prompt_tokens(tokenizer, conversation) -> int:
    if COMPLETION:
        return len(tokenizer(conversation)["input_ids"])
    return len(tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=False))


def distinct_text(k: int, tokens_wanted: int, tokenizer) -> str:
    """A ~`tokens_wanted`-token text of its own for chat k: no chunk of it matches another k's."""
    sentence = "Archive {k}, record {j}: the gauge in room {h} of wing {k} read {v} at dawn. "
    text, i = "", 0
    while len(tokenizer(text)["input_ids"]) < tokens_wanted:
        text += "".join(sentence.format(k=k, j=j, h=(j * (k + 3)) % 17, v=(j * 41 + k) % 97) for j in range(i, i + 50))
        i += 50
    return tokenizer.decode(tokenizer(text)["input_ids"][:tokens_wanted])


def wave(engine: Engine, conversations: list, new_tokens: int = NEW_TOKENS) -> dict:
    """Run the conversations at once (one thread each, as framework batch calls do)."""
    out: list = [None] * len(conversations)
    gaps: list[float] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        c = conversations[i]
        stream = (engine.stream if isinstance(c, str) else engine.stream_chat)(c, max_new_tokens=new_tokens,
                                                                              min_new_tokens=new_tokens)
        last, mine = time.perf_counter(), []
        for _ in stream:
            now = time.perf_counter()
            mine.append(now - last)
            last = now
        with lock:
            gaps.extend(mine[1:])                          # between tokens (the first gap is the TTFT)
        out[i] = stream.generation

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(conversations))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    tokens = sum(g.completion_tokens for g in out)
    decode = len(conversations) * len(gaps) / sum(gaps) if gaps else float("nan")
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, "gens": out, "decode_tok_s": decode,
            "ttft_s": statistics.median(g.ttft_s for g in out), "gaps": gaps}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def paired_at_8(engine: Engine, conversations: list, pairs: int) -> dict:
    """The speed-up of the conversations at once measured against serial runs made right before
    each wave, `pairs` times: the machine's speed drifts over a run (this 2-core VM by up to 20%
    within a minute), and a serial baseline taken once, a minute before, carries that drift into
    the ratio. greedy_same_as_serial: every wave's replies are the serial ones."""
    out, same = [], True
    for _ in range(pairs):
        serial = [wave(engine, [c]) for c in conversations]
        serial_tok_s = sum(w["tokens"] for w in serial) / sum(w["wall_s"] for w in serial)
        serial_decode = len(serial) / sum(1 / w["decode_tok_s"] for w in serial)     # 1 / mean gap
        batched = wave(engine, conversations)
        same = same and [g.token_ids for g in batched["gens"]] == [w["gens"][0].token_ids for w in serial]
        out.append({"serial_tok_s": round(serial_tok_s, 2), "batched_tok_s": round(batched["tok_s"], 2),
                    "speedup": round(batched["tok_s"] / serial_tok_s, 2),
                    "serial_decode_tok_s": round(serial_decode, 2), "batched_decode_tok_s": round(batched["decode_tok_s"], 2),
                    "decode_speedup": round(batched["decode_tok_s"] / serial_decode, 2)})
        print("paired", out[-1], flush=True)
    return {"pairs": out, "median_speedup": statistics.median(p["speedup"] for p in out),
            "median_decode_speedup": statistics.median(p["decode_speedup"] for p in out),
            "greedy_same_as_serial": same}


def section_levels(model, tokenizer) -> dict:
    system = long_text(SYSTEM_TOKENS, tokenizer)
    engine = Engine(model, tokenizer, **ENGINE_OPTIONS)
    engine.warm(system_part(system))
    serial = [wave(engine, [c]) for c in chats(system, 8)]
    serial_tok_s = sum(w["tokens"] for w in serial) / sum(w["wall_s"] for w in serial)
    reference = [w["gens"][0].token_ids for w in serial]
    steps: list[float] = []
    on = lambda e: steps.append(e.seconds) if isinstance(e, ForwardEvent) and e.kind == "decode" else None
    with engine.instruments.subscribe(on):
        wave(engine, chats(system, 1))
    step_1 = statistics.median(steps)
    rows, steps_8 = [], []
    on_8 = lambda e: steps_8.append(e.seconds) if isinstance(e, ForwardEvent) and e.sequences == 8 == e.tokens else None
    for n in (1, 2, 4, 8, 16):
        with engine.instruments.subscribe(on_8):
            w = wave(engine, chats(system, n))
        same = [g.token_ids for g in w["gens"][:8]] == reference[:min(n, 8)]
        rows.append({"concurrent": n, "tok_s": round(w["tok_s"], 2), "speedup_vs_serial": round(w["tok_s"] / serial_tok_s, 2),
                     "decode_tok_s": round(w["decode_tok_s"], 2),
                     "p50_token_ms": round(1000 * percentile(w["gaps"], 0.5), 1),
                     "p99_token_ms": round(1000 * percentile(w["gaps"], 0.99), 1),
                     "median_ttft_s": round(w["ttft_s"], 3), "greedy_same_as_serial": same})
        print(rows[-1], flush=True)
    paired = paired_at_8(engine, chats(system, 8), PAIRS)
    read = weight_read_s(model)
    engine.close()
    step_8 = statistics.median(steps_8) if steps_8 else float("nan")
    out = {"serial_tok_s": round(serial_tok_s, 2), "decode_step_1_ms": round(1000 * step_1, 1),
           "decode_step_8_ms": round(1000 * step_8, 1), "step_speedup_at_8": round(8 * step_1 / step_8, 2),
           "paired_at_8": paired, "weight_read_ms": round(1000 * read, 1),
           "bound_at_8": round(8 * step_1 / max(read, step_1 / 8), 2),
           "note": "bound_at_8: 8 tokens per step if a step at 8 cost no more than reading the weights "
                   "once (8 x step_1 / max(weight_read, step_1 / 8)); step_speedup_at_8: 8 x step_1 / "
                   "the measured decode step of 8 sequences (what the step gives before scheduling); "
                   "bound_at_8_linear (float weights only): if a step at 8 cost a step at 1 plus only "
                   "the extra time of the weight products on 8 rows (8 x step_1 / (step_1 + linear_8 - linear_1))",
           "rows": rows}
    if any(isinstance(m, torch.nn.Linear) for m in model.modules()):
        linear_1, linear_8 = linear_s(model, 1), linear_s(model, 8)
        out.update({"linear_ms_1_row": round(1000 * linear_1, 1), "linear_ms_8_rows": round(1000 * linear_8, 1),
                    "bound_at_8_linear": round(8 * step_1 / (step_1 + linear_8 - linear_1), 2)})
    return out


def section_unshared(model, tokenizer) -> dict:
    systems = [distinct_text(k, SYSTEM_TOKENS, tokenizer) for k in range(8)]
    conversations = [one_chat(s, q) for s, q in zip(systems, QUESTIONS)]
    engine = Engine(model, tokenizer, **ENGINE_OPTIONS)
    for s in systems:
        engine.warm(system_part(s))
    paired = paired_at_8(engine, conversations, PAIRS)
    context = statistics.mean(prompt_tokens(tokenizer, c) for c in conversations)
    weight_bytes, kv_bytes = step_read_bytes(model), int((context + NEW_TOKENS / 2) * kv_bytes_per_token(engine))
    engine.close()
    return {**paired, "system_tokens_each": SYSTEM_TOKENS, "weight_read_bytes": weight_bytes,
            "kv_read_bytes_per_sequence": kv_bytes, "read_bound_at_8": unshared_bound(weight_bytes, kv_bytes),
            "note": "8 chats, each over its own warmed system prompt (system_tokens_each): every sequence reads its "
                    "own KV; speedup: wall tokens/s at once over serial; decode_speedup: sequences / mean gap "
                    "between tokens at once over 1 / mean gap serially; read_bound_at_8: the speed-up if a step "
                    "cost only its memory reads, 8 (W + K) / (W + 8 K), W the weights a step reads, K one "
                    "sequence's KV at its mean length (prompt + half the new tokens)"}


def section_transformers(model, tokenizer) -> dict:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    system = long_text(SYSTEM_TOKENS, tokenizer)
    conversations = chats(system, 8)
    theirs, _ = load_default()          # a model of its own: ours registers our attention on its model
    ids = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False)
           for c in conversations]
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    cb = ContinuousBatchingConfig(allow_block_sharing=True, num_blocks=256, max_batch_tokens=512)
    out = {"transformers": [], "kvboost": []}
    for wave_no in (1, 2):
        start = time.perf_counter()
        results = theirs.generate_batch(ids, generation_config=config, continuous_batching_config=cb,
                                       record_timestamps=True, warmup=False, persistent_manager=True)
        wall = time.perf_counter() - start
        tokens = sum(len(r.generated_tokens) for r in results.values())
        ttfts = [r.timestamps[0] - r.created_time for r in results.values() if r.timestamps]
        out["transformers"].append({"wave": wave_no, "wall_s": round(wall, 2), "tok_s": round(tokens / wall, 2),
                                    "median_ttft_s": round(statistics.median(ttfts), 3)})
        print(out["transformers"][-1], flush=True)
    if hasattr(theirs, "destroy_cached_continuous_batching_manager"):
        theirs.destroy_cached_continuous_batching_manager()
    del theirs
    engine = Engine(model, tokenizer, **ENGINE_OPTIONS)
    for wave_no in (1, 2):
        w = wave(engine, conversations)
        out["kvboost"].append({"wave": wave_no, "wall_s": round(w["wall_s"], 2), "tok_s": round(w["tok_s"], 2),
                               "median_ttft_s": round(w["ttft_s"], 3)})
        print(out["kvboost"][-1], flush=True)
    engine.close()
    return out


def section_prefill(model, tokenizer) -> dict:
    long_prompt = long_text(4000, tokenizer)
    engine = Engine(model, tokenizer, **{**ENGINE_OPTIONS, "cache_bytes": 0})
    chunk = engine.config.prefill_chunk_tokens
    alone = engine.generate("Hi, who are you?", max_new_tokens=2)
    chunk_s: list[float] = []
    on = lambda e: chunk_s.append(e.seconds) if isinstance(e, ForwardEvent) else None
    with engine.instruments.subscribe(on):
        long = engine.stream(long_prompt, max_new_tokens=2)
        time.sleep(0.5)                                      # the long prefill is under way
        short = engine.generate("Hi, who are you?", max_new_tokens=2)
        long_gen = long.collect()
    engine.close()
    return {"prefill_chunk_tokens": chunk, "long_prompt_tokens": long_gen.prompt_tokens,
            "long_ttft_s": round(long_gen.ttft_s, 3), "short_ttft_s": round(short.ttft_s, 3),
            "short_alone_ttft_s": round(alone.ttft_s, 3), "max_forward_s": round(max(chunk_s), 3),
            "note": "the short request joins the next chunk's forward: its TTFT is about one chunk "
                    "plus its own prompt, not the whole long prefill"}


def section_memory(model, tokenizer) -> dict:
    system = long_text(SYSTEM_TOKENS, tokenizer)
    engine = Engine(model, tokenizer, **ENGINE_OPTIONS)
    engine.warm([{"role": "system", "content": system}])
    prompt_blocks = engine.stats()["pool_blocks_used"]
    streams = [engine.stream_chat(c, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS) for c in chats(system, 16)]
    for s in streams:
        next(s)
    used = engine.stats()["pool_blocks_used"]
    for s in streams:
        s.collect()
    engine.close()
    return {"system_prompt_blocks": prompt_blocks, "blocks_in_use_at_16": used,
            "sixteen_copies_would_be": 16 * prompt_blocks,
            "per_chat_own_blocks": round((used - prompt_blocks) / 16, 1)}


SECTIONS = {"levels": section_levels, "unshared": section_unshared, "transformers": section_transformers,
            "prefill": section_prefill, "memory": section_memory}
PER_WEIGHTS = ("levels", "unshared")             # the others run on the first weights only


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default=",".join([*SECTIONS, "llama"]))
    parser.add_argument("--weights", default="fp32,int4", help="comma list of fp32, int4")
    parser.add_argument("--gguf", help="also this GGUF file as stored (weights 'gguf'); llama runs on it")
    parser.add_argument("--llama-threads", type=int, default=2, help="llama-batched-bench -t")
    parser.add_argument("--kv-dtype", default="", help="our engines' KV element type (EngineConfig.kv_dtype: "
                        "float32, float16, bfloat16, int8; default: the model's dtype)")
    parser.add_argument("--cache-gib", type=float, help="our engines' cache_bytes in GiB (default: the engine's, "
                        "2 GiB; at a real size 8 warmed ~1k-token prompts can outgrow it, and are then prefilled again)")
    parser.add_argument("--kv-pool-gib", type=float, help="our engines' kv_pool_bytes in GiB (default: the engine's, "
                        "cache_bytes plus two full-window requests, at most half the memory)")
    parser.add_argument("--out", default="benchmarks/results/batching.json")
    parser.add_argument("--completion", action="store_true", help="plain prompts through engine.stream, not chats "
                        "(a base model without a chat template; levels and unshared)")
    parser.add_argument("--system-tokens", type=int, help="the system prompts' length in tokens (levels, "
                        "unshared, transformers, memory; default 1000), and llama-batched-bench's prompt (default "
                        "400): the share of attention in a step, and the unshared read bound, move with it")
    parser.add_argument("--smoke", action="store_true", help="8 new tokens over a 100-token system prompt; "
                        "llama-batched-bench on 16 prompt tokens and 4 new")
    args = parser.parse_args(argv)
    global NEW_TOKENS, SYSTEM_TOKENS, PAIRS, COMPLETION
    COMPLETION = args.completion
    if args.smoke:
        NEW_TOKENS, SYSTEM_TOKENS, PAIRS = 8, 100, 1
    if args.system_tokens is not None:
        if args.system_tokens < 1:
            parser.error("--system-tokens must be at least 1")
        SYSTEM_TOKENS = args.system_tokens
    if args.kv_dtype:
        ENGINE_OPTIONS["kv_dtype"] = args.kv_dtype
    if args.cache_gib is not None:
        ENGINE_OPTIONS["cache_bytes"] = int(args.cache_gib * 1024**3)
    if args.kv_pool_gib is not None:
        ENGINE_OPTIONS["kv_pool_bytes"] = int(args.kv_pool_gib * 1024**3)
    names = [w for w in args.weights.split(",") if w] + (["gguf"] if args.gguf else [])
    sections = args.sections.split(",")
    if args.completion and set(sections) - {*PER_WEIGHTS, "llama"}:
        parser.error("--completion runs the levels, unshared and llama sections only")
    result: dict = {"weights": names, "kv_dtype": args.kv_dtype or "model", "system_tokens": SYSTEM_TOKENS,
                    "cache_bytes": ENGINE_OPTIONS.get("cache_bytes", "default"),
                    "kv_pool_bytes": ENGINE_OPTIONS.get("kv_pool_bytes", "default")}
    for index, name in enumerate(names):
        wanted = [s for s in sections if s in SECTIONS and (s in PER_WEIGHTS or index == 0)]
        if not wanted:
            continue
        model, tokenizer = load_default() if name == "fp32" else load_weights(name, args.gguf)
        # the model named as run: the GGUF file where one was given (else the default model)
        result.setdefault("environment", environment(model, Path(args.gguf).name if name == "gguf" else "default"))
        result[name] = {}
        for section in wanted:
            print(f"== {section} ({name})", flush=True)
            with torch.inference_mode():
                result[name][section] = SECTIONS[section](model, tokenizer)
        del model
    if "llama" in sections:
        print("== llama", flush=True)
        result["llama"] = llama_batched(args.gguf, args.llama_threads, args.smoke, args.system_tokens)
    result["summary"] = summary(result)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "environment"}, indent=2))
    print(summary_table(result["summary"]))


if __name__ == "__main__":
    main()
