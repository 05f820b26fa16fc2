"""Demo: a multi-turn chat on the default model, cold (no cache) vs warm (kvboost) TTFT.

Run: `python -m kvboost_tools.demo` (or `bash dev.sh demo`).
"""
from __future__ import annotations

import argparse
import time

from kvboost_engine import Engine, KVBoostError

SYSTEM_PROMPT = (
    "You are Ada, the support assistant of Northwind Outfitters, a shop for hiking and camping gear. "
    "Answer in one or two short sentences. Store facts: the flagship store is in Portland and opens at "
    "9 am on weekdays and 10 am on weekends. Returns are accepted within 60 days with a receipt. "
    "Members of the Trail Club get free shipping on orders over 40 dollars and 10 percent off tents. "
    "The warranty on backpacks is five years; on tents it is two years; on stoves it is one year. "
) * 4
QUESTIONS = [
    "When does the Portland store open on Saturday?",
    "How long is the warranty on a backpack?",
    "Do Trail Club members pay for shipping on a 55 dollar order?",
    "Can I return a tent after 45 days?",
    "What discount do members get on tents?",
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="HF dir, .gguf or hub id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be at least 1")
    started = time.perf_counter()
    try:
        warm = Engine.from_pretrained(args.model)
    except KVBoostError as err:
        raise SystemExit(f"kvboost: {err}") from None
    if not getattr(warm.tokenizer, "chat_template", None):
        raise SystemExit(f"kvboost: {warm.model_name} has no chat template; the demo is a chat (a base model: "
                         "engine.generate with a plain prompt)")
    cold = Engine(warm.model, warm.tokenizer, cache_bytes=0, model_name=warm.model_name)
    print(f"loaded {warm.model_name} in {time.perf_counter() - started:.1f}s "
          f"({warm.adapter.dtype}, {warm.adapter.device})\n")
    print(f"{'turn':>4} {'prompt':>7} {'reused':>7} {'cold TTFT':>10} {'warm TTFT':>10} {'speedup':>8}  reply")
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    for turn, question in enumerate(QUESTIONS, 1):
        messages.append({"role": "user", "content": question})
        try:
            baseline = cold.chat(messages, max_new_tokens=1)
            reply = warm.chat(messages, max_new_tokens=args.max_new_tokens)
        except KVBoostError as err:             # a model whose window the growing chat outgrows
            raise SystemExit(f"kvboost: turn {turn}: {err}") from None
        messages.append({"role": "assistant", "content": reply.text})
        print(f"{turn:>4} {reply.prompt_tokens:>7} {reply.reused_tokens:>7} {baseline.ttft_s * 1e3:>8.0f}ms "
              f"{reply.ttft_s * 1e3:>8.0f}ms {baseline.ttft_s / reply.ttft_s:>7.1f}x  {reply.text[:60]!r}")
    stats = warm.stats()
    print(f"\ncache: {stats['bytes_used'] / 2**20:.1f} MiB in {stats['nodes']} chunks, "
          f"{stats['hits']} hits / {stats['lookups']} lookups")


if __name__ == "__main__":
    main()
