"""Multi-turn replay: TTFT of plain transformers, the engine cold and warm, and the floor.

Per turn it prints prompt tokens, reused tokens and median TTFTs over repeats:
  plain  - transformers: chat template + one forward over the whole prompt (logits of the last position)
  cold   - our engine with cache_bytes=0 (same code path, nothing stored)
  warm   - our engine replaying the conversation, so turns >= 2 reuse the previous turns
  floor  - transformers running only the tokens the warm engine computed, over a DynamicCache
           already filled with the rest (the best any cache can do; a forward never costs
           less than reading all weights once). The cache is a fresh copy each run, and CPU
           caches are flushed after copying it (128 MiB written), as for the warm engine,
           whose KV was written long before (the previous turn's decode streamed the weights
           through the caches since)
and decode tokens/s of the engine vs `model.generate` (greedy, 128 new tokens).

A model with a chat template (the default) chats through `engine.chat`. A base model without one
(gemma3-270m) gets the same conversation as a plain-text transcript through `engine.generate`:
the system text, then "User: <question>\nAssistant:" and the reply (read up to a newline) per
turn, each its own segment; plain transformers tokenizes the joined text.

Run: python -m benchmarks.micro.multiturn [--model default|gemma3-270m --turns 8 --repeats 5
     --out benchmarks/results/multiturn.json (default; multiturn_<model>.json for other models)]
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
from transformers import DynamicCache

from kvboost_engine import Engine

from .._common import MODELS, environment, load_model, median_time, save_result

SYSTEM_PROMPT = " ".join([
    "You are Sol, the in-house assistant of the Helios solar panel company.",
    "Always answer in at most two sentences and never invent prices.",
    "Product facts: the H-300 panel delivers 300 watts, weighs 18 kilograms and has a 25 year warranty.",
    "The H-420 panel delivers 420 watts, weighs 22 kilograms and has a 30 year warranty.",
    "The Atlas inverter converts up to 6 kilowatts and has a 10 year warranty, extendable to 15 years.",
    "Installation takes one or two days for a typical house and requires a roof inspection first.",
    "Customers can pay in full or over 24 months at zero interest after a credit check.",
    "The support line is open from 8 am to 8 pm on weekdays and from 9 am to 1 pm on Saturdays.",
]) * 5
QUESTIONS = [
    "How much power does the H-420 deliver?", "What is its warranty?", "And the inverter's warranty?",
    "How long does installation take?", "Can I pay in installments?", "When is support open on Saturday?",
    "How heavy is the H-300?", "Do I need a roof inspection?",
    "How many kilowatts can the Atlas inverter convert?", "Which panel is lighter, the H-300 or the H-420?",
]



def has_template(engine_or_tokenizer) -> bool:
    tokenizer = getattr(engine_or_tokenizer, "tokenizer", engine_or_tokenizer)
    return bool(getattr(tokenizer, "chat_template", None))


def ask(engine: Engine, prompt: list[dict], **params):
    """One turn: messages through engine.chat, transcript segments through engine.generate."""
    if "role" in prompt[0]:
        return engine.chat(prompt, **params)
    if "min_new_tokens" not in params:          # a reply in the transcript ends with its line
        params = {"stop": ["\n"], **params}
    return engine.generate(prompt, **params)


def encode(engine: Engine, prompt: list[dict]) -> list[int]:
    return (engine.encode_messages(prompt) if "role" in prompt[0] else engine.encode_prompt(prompt)).token_ids


def conversation(engine: Engine, turns: int, reply_tokens: int) -> list[list[dict]]:
    """The prompt at each turn (messages, or transcript segments for a model without a chat
    template), with the model's own greedy replies."""
    chat = has_template(engine)
    prompt = [{"role": "system", "content": SYSTEM_PROMPT}] if chat else [{"text": SYSTEM_PROMPT + "\n\n", "kind": "system"}]
    per_turn = []
    for question in QUESTIONS[:turns]:
        if chat:
            prompt = prompt + [{"role": "user", "content": question}]
        else:
            prompt = prompt + [{"text": f"User: {question}\nAssistant:", "kind": "user"}]
        per_turn.append(prompt)
        reply = ask(engine, prompt, max_new_tokens=reply_tokens)
        if chat:
            prompt = prompt + [{"role": "assistant", "content": reply.text}]
        else:
            prompt = prompt + [{"text": reply.text, "kind": "assistant"}, {"text": "\n", "kind": "glue"}]
    return per_turn


def warm_replay(model, tokenizer, turns: list[list[dict]], reply_tokens: int) -> list:
    """A fresh engine answering every turn in order: what a chat app sees."""
    engine = Engine(model, tokenizer)
    return [ask(engine, prompt, max_new_tokens=reply_tokens) for prompt in turns]


_EVICT = torch.empty(0)


def evict_cpu_caches() -> None:
    """Write a buffer larger than the last-level cache, so what was just touched is out of it."""
    global _EVICT
    if _EVICT.numel() == 0:
        _EVICT = torch.empty(128 * 2**20 // 4)
    _EVICT.fill_(1.0)


def floor_ttft(model, ids: list[int], reused: int, repeats: int) -> float:
    with torch.inference_mode():
        prefix = DynamicCache(config=model.config)
        if reused:
            model(torch.tensor([ids[:reused]]), past_key_values=prefix, use_cache=True)
        new = torch.tensor([ids[reused:]])

        def run():
            cache = copy.deepcopy(prefix)
            evict_cpu_caches()          # the copy left the KV in L3; the warm engine's KV is not
            started = time.perf_counter()
            out = model(new, past_key_values=cache, use_cache=True, logits_to_keep=1)
            out.logits[0, -1].argmax()
            return time.perf_counter() - started

        run()
        return statistics.median(run() for _ in range(repeats))


def plain_ttft(model, tokenizer, prompt, repeats: int) -> float:
    def run():
        with torch.inference_mode():
            if "role" in prompt[0]:
                ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_tensors="pt",
                                                    return_dict=True)["input_ids"]
            else:
                ids = tokenizer("".join(seg["text"] for seg in prompt), return_tensors="pt")["input_ids"]
            model(ids, logits_to_keep=1).logits[0, -1].argmax()
    return median_time(run, repeats)


def decode_speed(engine: Engine, model, prompt, new_tokens: int, repeats: int) -> dict:
    ids = torch.tensor([encode(engine, prompt)])

    def hf(n):
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)

    hf_decode = median_time(lambda: hf(new_tokens), repeats) - median_time(lambda: hf(1), repeats)
    runs = [ask(engine, prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens) for _ in range(repeats + 1)][1:]
    ours = statistics.median(g.total_s - g.ttft_s for g in runs)
    return {"new_tokens": new_tokens, "transformers_tok_s": (new_tokens - 1) / hf_decode,
            "engine_tok_s": (new_tokens - 1) / ours, "ratio": hf_decode / ours}


def run(turns: int, repeats: int, reply_tokens: int, model_name: str = "default") -> dict:
    model, tokenizer = load_model(model_name)
    cold = Engine(model, tokenizer, cache_bytes=0)
    per_turn = conversation(Engine(model, tokenizer), turns, reply_tokens)
    replays = [warm_replay(model, tokenizer, per_turn, reply_tokens) for _ in range(repeats + 1)][1:]
    cold_replies = [ask(cold, prompt, max_new_tokens=reply_tokens).token_ids for prompt in per_turn]
    rows = []
    for k, prompt in enumerate(per_turn):
        warm = [replay[k] for replay in replays]
        ids = encode(cold, prompt)
        row = {
            "turn": k + 1, "prompt_tokens": warm[0].prompt_tokens, "reused_tokens": warm[0].reused_tokens,
            "same_reply_as_no_cache": all(g.token_ids == cold_replies[k] for g in warm),
            "plain_ttft_s": plain_ttft(model, tokenizer, prompt, repeats),
            "cold_ttft_s": median_time(lambda: ask(cold, prompt, max_new_tokens=1), repeats),
            "warm_ttft_s": statistics.median(g.ttft_s for g in warm),
            "floor_ttft_s": floor_ttft(model, ids, warm[0].reused_tokens, repeats),
        }
        rows.append(row)
        print_row(row)
    late = [r for r in rows if r["turn"] >= 3]
    summary = {
        "replies_identical_to_no_cache": all(r["same_reply_as_no_cache"] for r in rows),
        "cold_over_plain_median": statistics.median(r["cold_ttft_s"] / r["plain_ttft_s"] for r in rows),
        "warm_over_floor_median_turn3plus": statistics.median(r["warm_ttft_s"] / r["floor_ttft_s"] for r in late),
        "plain_over_warm_median_turn3plus": statistics.median(r["plain_ttft_s"] / r["warm_ttft_s"] for r in late),
    }
    summary["decode"] = decode_speed(cold, model, per_turn[0], 128, repeats)
    prompt_format = "chat template" if has_template(tokenizer) else "plain-text transcript via generate"
    return {"benchmark": "multiturn", "environment": environment(model, model_name), "prompt_format": prompt_format,
            "turns": rows, "summary": summary}


def print_row(row: dict) -> None:
    ms = {k: row[k] * 1e3 for k in ("plain_ttft_s", "cold_ttft_s", "warm_ttft_s", "floor_ttft_s")}
    print(f"turn {row['turn']}: prompt {row['prompt_tokens']:>4} reused {row['reused_tokens']:>4} | "
          f"plain {ms['plain_ttft_s']:6.1f}ms cold {ms['cold_ttft_s']:6.1f}ms "
          f"warm {ms['warm_ttft_s']:6.1f}ms floor {ms['floor_ttft_s']:6.1f}ms", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="default")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--reply-tokens", type=int, default=32)
    parser.add_argument("--out", help="default benchmarks/results/multiturn.json, or multiturn_<model>.json")
    args = parser.parse_args(argv)
    result = run(args.turns, args.repeats, args.reply_tokens, args.model)
    print(json.dumps(result["summary"], indent=2))
    save_result(result, args.out, "multiturn", args.model)


if __name__ == "__main__":
    main()
