"""Quality of AWQ checkpoints: perplexity vs the fp32 default model, and a sample answer.

    python -m benchmarks.micro.awq_check --awq DIR [--awq DIR ...] [--tokens 1024,2048] [--kernel K]
           [--through model|step] [--out FILE]

Perplexity is over the first N tokens of the fixed evaluation text (texts.evaluation_text,
3245 tokens), in windows of 512. `--through step` (default) runs each token through the engine's own
step (the native step where the engine takes it, the fp32 model's too): the numbers a user's
generation gets, and the only way to score awq_kernel="native" (its module tree computes in float32
instead); `--through model` each window through the HF module tree in one forward (how figures
before 2026-12-07 were measured).
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--awq", action="append", required=True)
    parser.add_argument("--tokens", default="1024,2048", help="evaluation lengths (first N tokens of the text)")
    parser.add_argument("--kernel", default=None, help="AWQ kernel (default: the engine's choice)")
    parser.add_argument("--through", choices=("model", "step"), default="step")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    from kvboost_engine import Engine
    from kvboost_engine.loading import default_model_dir, load_model_and_tokenizer

    lengths = [int(n) for n in args.tokens.split(",")]
    model, tokenizer = load_model_and_tokenizer(default_model_dir(), device=torch.device("cpu"), dtype=torch.float32)
    fp32 = Engine(model, tokenizer, cache_bytes=0)
    report = {"fp32": {**perplexities(fp32, lengths, args.through),
                       "answer": fp32.chat(QUESTION, max_new_tokens=24).text, "through": args.through}}
    for path in args.awq:
        engine = Engine.from_pretrained(path, cache_bytes=0, awq_kernel=args.kernel)
        ppl = perplexities(engine, lengths, args.through)
        ratios = {f"ratio_to_fp32_{n}": ppl[f"perplexity_{n}"] / report["fp32"][f"perplexity_{n}"] for n in lengths}
        report[path] = {**ppl, **ratios, "answer": engine.chat(QUESTION, max_new_tokens=24).text,
                        "awq_kernel": engine.stats()["awq_kernel"]}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)


def perplexities(engine, lengths: list[int], through: str) -> dict[str, float]:
    from kvboost_tools.awq.quality import perplexity
    if through == "model":
        return {f"perplexity_{n}": perplexity(engine.model, engine.tokenizer, max_tokens=n) for n in lengths}
    return {f"perplexity_{n}": step_perplexity(engine, n) for n in lengths}


def step_perplexity(engine, max_tokens: int, window: int = 512) -> float:
    """perplexity()'s windows and scored positions, each token through the engine's step."""
    from kvboost_tools.awq.texts import evaluation_text

    from .gguf_ppl import window_logits
    ids = engine.tokenizer(evaluation_text())["input_ids"][:max_tokens]
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start:start + window]
        for logits, target in window_logits(engine, chunk, 0, "decode"):
            nll -= float(torch.log_softmax(logits.float(), dim=-1)[target])
            count += 1
    return math.exp(nll / count)


if __name__ == "__main__":
    main()
