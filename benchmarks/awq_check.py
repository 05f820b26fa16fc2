"""Quality of AWQ checkpoints: perplexity vs the fp32 default model, and a sample answer.

    python -m benchmarks.awq_check --awq DIR [--awq DIR ...] [--out FILE]
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
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    from kvboost_engine import Engine
    from kvboost_engine.awq.quality import perplexity
    from kvboost_engine.loading import default_model_dir, load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(default_model_dir(), device=torch.device("cpu"), dtype=torch.float32)
    report = {"fp32": {"perplexity": perplexity(model, tokenizer)}}
    report["fp32"]["answer"] = Engine(model, tokenizer, cache_bytes=0).chat(QUESTION, max_new_tokens=24).text
    for path in args.awq:
        engine = Engine.from_pretrained(path, cache_bytes=0)
        ppl = perplexity(engine.model, engine.tokenizer)
        report[path] = {"perplexity": ppl, "ratio_to_fp32": ppl / report["fp32"]["perplexity"],
                        "answer": engine.chat(QUESTION, max_new_tokens=24).text,
                        "awq_kernel": engine.stats()["awq_kernel"]}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
