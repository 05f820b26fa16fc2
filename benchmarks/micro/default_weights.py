"""The default model in its own numbers? Replies of the GGUF as stored (weights="gguf": the file's
4-bit codes and fp16 scales, the native step with int8 activations) against the exact default (the
GGUF dequantized to float32), on the multiturn benchmark's conversation; and decode speed of each.

Both engines chat the same conversation, each with its own replies carried in its history (what a
user sees); a turn counts as differing when its reply text differs. Then each engine replays the
other's exact prompts (the conversation of the fp32 engine) so a single early difference does not
count as every later turn: `same_prompts_differ` is the fair per-turn count.

Run: python -m benchmarks.micro.default_weights [--model default|gemma3-270m --turns 10 --reply-tokens 48]
"""
from __future__ import annotations

import argparse
import time

from kvboost_engine import Engine

from .._common import environment, save_result
from .multiturn import QUESTIONS, ask, conversation

WEIGHTS = ("fp32", "gguf")


def _engine(model: str, weights: str) -> Engine:
    if model == "default":
        return Engine.from_pretrained(weights=weights)
    from kvboost_engine.named_models import fetch_gguf, named_model
    from kvboost_engine.paths import cache_home
    folder = cache_home() / "models" / "bench-gguf"
    folder.mkdir(parents=True, exist_ok=True)
    named = named_model(model)
    path = folder / named.gguf_name
    if not path.exists():
        fetch_gguf(named, folder)
    return Engine.from_pretrained(path, weights=weights)


def _decode_speed(engine: Engine, prompt: list[dict], tokens: int = 64) -> float:
    ask(engine, prompt, max_new_tokens=4)
    best = 0.0
    for _ in range(3):
        began = time.perf_counter()
        reply = ask(engine, prompt, max_new_tokens=tokens, min_new_tokens=tokens)
        best = max(best, reply.completion_tokens / (time.perf_counter() - began))
    return best


def run(model: str, turns: int, reply_tokens: int) -> dict:
    engines = {w: _engine(model, w) for w in WEIGHTS}
    own = {w: conversation(e, turns, reply_tokens) for w, e in engines.items()}
    reference_turns = own["fp32"]
    replies = {w: [ask(e, p, max_new_tokens=reply_tokens).text for p in reference_turns] for w, e in engines.items()}
    differ = [i for i in range(turns) if replies["fp32"][i] != replies["gguf"][i]]
    histories_differ = sum(a[-1] != b[-1] for a, b in zip(own["fp32"][1:], own["gguf"][1:]))
    speed = {w: round(_decode_speed(e, reference_turns[0]), 1) for w, e in engines.items()}
    stats = {w: {k: v for k, v in e.stats().items() if k.startswith(("weights", "native"))} for w, e in engines.items()}
    return {"environment": environment(engines["fp32"].model, model), "model": model, "turns": turns, "reply_tokens": reply_tokens,
            "same_prompts_differ": len(differ), "differing_turns": differ,
            "own_histories_differ_from_turn2": histories_differ,
            "examples": [{"turn": i, "question": QUESTIONS[i], "fp32": replies["fp32"][i], "gguf": replies["gguf"][i]}
                         for i in differ[:3]],
            "decode_tok_s": speed, "stats": stats}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", choices=["default", "gemma3-270m"])
    parser.add_argument("--turns", type=int, default=len(QUESTIONS))
    parser.add_argument("--reply-tokens", type=int, default=48)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    result = run(args.model, args.turns, args.reply_tokens)
    print(f"{args.model}: replies differ on {result['same_prompts_differ']}/{args.turns} turns (same prompts); "
          f"decode tok/s {result['decode_tok_s']}")
    for example in result["examples"]:
        print(f"  turn {example['turn']}: fp32 {example['fp32']!r}\n          gguf {example['gguf']!r}")
    save_result(result, args.out, "default_weights", args.model)


if __name__ == "__main__":
    main()
