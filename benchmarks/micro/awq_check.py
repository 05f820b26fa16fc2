"""Quality of AWQ checkpoints: perplexity vs the fp32 default model, and a sample answer.

    python -m benchmarks.micro.awq_check --awq DIR [--awq DIR ...] [--tokens 1024,2048] [--out FILE]

Perplexity is over the first N tokens of the fixed evaluation text (texts.evaluation_text,
3245 tokens), in windows of 512.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--awq", action="append", required=True)
    parser.add_argument("--tokens", default="1024,2048", help="evaluation lengths (first N tokens of the text)")
    parser.add_argument("--kernel", default=None, help="AWQ kernel (default: the engine's choice)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    from kvboost_engine import Engine
    from kvboost_engine.loading import default_model_dir, load_model_and_tokenizer

    lengths = [int(n) for n in args.tokens.split(",")]
    model, tokenizer = load_model_and_tokenizer(default_model_dir(), device=torch.device("cpu"), dtype=torch.float32)
    report = {"fp32": {**perplexities(model, tokenizer, lengths),
                       "answer": Engine(model, tokenizer, cache_bytes=0).chat(QUESTION, max_new_tokens=24).text}}
    for path in args.awq:
        engine = Engine.from_pretrained(path, cache_bytes=0, awq_kernel=args.kernel)
        ppl = perplexities(engine.model, engine.tokenizer, lengths)
        ratios = {f"ratio_to_fp32_{n}": ppl[f"perplexity_{n}"] / report["fp32"][f"perplexity_{n}"] for n in lengths}
        report[path] = {**ppl, **ratios, "answer": engine.chat(QUESTION, max_new_tokens=24).text,
                        "awq_kernel": engine.stats()["awq_kernel"]}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)


def perplexities(model, tokenizer, lengths: list[int]) -> dict[str, float]:
    from kvboost_tools.awq.quality import perplexity
    return {f"perplexity_{n}": perplexity(model, tokenizer, max_tokens=n) for n in lengths}


if __name__ == "__main__":
    main()
