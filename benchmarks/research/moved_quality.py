"""Quality and TTFT of moved reuse on a seeded multi-document QA set (default model or Gemma 3 270M).

Every document of the pool is seen once first (warm-up prompts of five documents); then each
question comes with its document and four distractors in a new order, so documents are
found cached at other positions. Configurations, each its own engine on the same model:

  no-cache   cache_bytes=0: full prefill every time (the reference)
  exact      exact-prefix reuse only (moved_reuse="full": moved tokens are recomputed)
  none       moved reuse, keys re-rotated, nothing recomputed
  blend-R    moved reuse, recompute the R share of moved tokens chosen by KV deviation
  full       moved reuse with R = 1.0 (everything recomputed: must equal no-cache)

Reported per configuration: accuracy (answer string in the reply), its gap to no-cache with the
paired standard error (about 2.5-3 points at 200 questions here), agreement of the greedy
reply with no-cache's, mean KL(no-cache || config) of the first answer token, reuse ratios,
median TTFT and TTFT speedup over no-cache, and the cost model's prediction for blend.
Questions run interleaved over configurations so machine noise hits all of them alike.

Prompt format. The default model is an instruct model: a system prompt, then the documents as
parts of the user message, through `engine.chat`. Gemma 3 270M is the pretrained base model (no
chat template), so it gets a few-shot completion through `engine.generate`: one instruction
line, two worked examples (two short documents, a question, the answer in a few words), then
"Document: ..." lines (each document its own segment, found again wherever it lands), the
question and "Answer:"; the reply is read up to the first newline. On Gemma, the window rule
(EngineConfig.moved_window_rule) keeps documents shorter than the 512-token window from being
moved at all; --no-window-rule measures moved reuse without it.

Run: python -m benchmarks.research.moved_quality [--model default|gemma3-270m --questions 200 --seed 0
     --ratios 0.05,0.15,0.3 --no-window-rule --out benchmarks/results/moved_quality.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from kvboost_engine import Engine

from .._common import MODELS, environment, load_model, with_first_logits
from ..data.qa import build

SYSTEM = "Answer the question using the documents. Reply with the answer only, in a few words."
RATIOS = (0.05, 0.15, 0.3)
FEW_SHOT = (
    "Answer each question with a few words taken from the documents.\n\n"
    "Document: The Corlin Society was founded in 1952. It is based in the city of Oslo. Its director is Ana Ruiz. "
    "The code word of the Corlin Society is ember.\n"
    "Document: The Mavet Guild was founded in 1907. It is based in the city of Lima. Its director is Jon Berg. "
    "The code word of the Mavet Guild is onyx.\n"
    "Question: Who is the director of the Mavet Guild?\nAnswer: Jon Berg\n\n"
    "Document: The Pellor Institute was founded in 1984. It is based in the city of Perth. Its director is Mia Holt. "
    "The code word of the Pellor Institute is cedar.\n"
    "Document: The Sorvan Foundation was founded in 1899. It is based in the city of Dakar. Its director is Ravi Sen. "
    "The code word of the Sorvan Foundation is flint.\n"
    "Question: In which city is the Sorvan Foundation based?\nAnswer: Dakar\n\n")


def messages_for(documents, question: str) -> list[dict]:
    parts = [{"type": "document", "text": d} for d in documents] + [{"type": "text", "text": f"Question: {question}"}]
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": parts}]


def completion_for(documents, question: str) -> list[dict]:
    """The base-model prompt: few-shot examples, then each document as its own segment, then the question."""
    return ([{"text": FEW_SHOT, "kind": "system"}]
            + [{"text": f"Document: {d}\n", "kind": "document"} for d in documents]
            + [{"text": f"Question: {question}\nAnswer:", "kind": "text"}])


def request(engine: Engine, documents, question: str, **params):
    """One question through the prompt format the model follows (chat template, else few-shot completion)."""
    if getattr(engine.tokenizer, "chat_template", None):
        return engine.chat(messages_for(documents, question), **params)
    return engine.generate(completion_for(documents, question), **params)


def configurations(ratios=RATIOS, window_rule: bool = True) -> dict[str, dict]:
    """Engine options of each configuration (moved reuse is opt-in: every moved one names its strategy)."""
    moved = dict(moved_window_rule=window_rule)
    configs = {"no-cache": dict(cache_bytes=0), "exact": dict(moved_reuse="full"),
               "none": dict(moved_reuse="none", **moved)}
    configs.update({f"blend-{r}": dict(moved_reuse="blend", recompute_ratio=r, **moved) for r in ratios})
    configs["full"] = dict(moved_reuse="blend", recompute_ratio=1.0, **moved)
    return configs


def engines(model, tokenizer, budget: int, ratios=RATIOS, window_rule: bool = True) -> dict[str, Engine]:
    return {name: Engine(model, tokenizer, **{"cache_bytes": budget, **opts})
            for name, opts in configurations(ratios, window_rule).items()}


def warm_up(engine: Engine, docs: list[str]) -> None:
    for i in range(0, len(docs), 5):
        request(engine, docs[i:i + 5], "Which organisations are described?", max_new_tokens=1)


def kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    p = torch.log_softmax(reference.double(), -1)
    q = torch.log_softmax(other.double(), -1)
    return float((p.exp() * (p - q)).sum())


def ask(engine: Engine, question) -> dict:
    g, logits = with_first_logits(engine, lambda: request(engine, question.documents, question.question,
                                                          max_new_tokens=12, stop=["\n"]))
    return {"text": g.text.strip(), "correct": question.answer.lower() in g.text.lower(), "ttft_s": g.ttft_s,
            "prompt_tokens": g.prompt_tokens, "reused_exact": g.reused_exact, "reused_moved": g.reused_moved,
            "recomputed": g.recomputed, "logits": logits}


def paired_gap(correct: list[bool], reference: list[bool]) -> tuple[float, float]:
    """Accuracy gap (config minus reference) over the same questions, and its standard error.

    Only questions answered correctly by one side and not the other move the gap, so its error
    comes from those: with d_i in {-1, 0, 1}, SE = sqrt(var(d) / n).
    """
    if len(correct) != len(reference) or not correct:
        raise ValueError("paired_gap needs two equally long, non-empty lists of outcomes")
    d = [int(bool(a)) - int(bool(b)) for a, b in zip(correct, reference)]
    n, mean = len(d), statistics.mean(d)
    variance = statistics.mean(x * x for x in d) - mean * mean
    return mean, (variance / n) ** 0.5


def summarise(name: str, rows: list[dict], reference: list[dict], layers: int) -> dict:
    doc_share = statistics.mean((r["reused_exact"] + r["reused_moved"]) / r["prompt_tokens"] for r in rows)
    summary = {
        "config": name, "accuracy": statistics.mean(r["correct"] for r in rows),
        "agreement_with_no_cache": statistics.mean(r["text"] == b["text"] for r, b in zip(rows, reference)),
        "mean_kl_first_token": statistics.mean(kl(b["logits"], r["logits"]) for r, b in zip(rows, reference)),
        "reused_share": doc_share,
        "recomputed_share_of_moved": (sum(r["recomputed"] for r in rows) / max(1, sum(r["reused_moved"] for r in rows))),
        "median_ttft_s": statistics.median(r["ttft_s"] for r in rows),
        "median_ttft_speedup": statistics.median(b["ttft_s"] / r["ttft_s"] for r, b in zip(rows, reference)),
    }
    summary["accuracy_gap"], summary["accuracy_gap_se"] = paired_gap([r["correct"] for r in rows],
                                                                     [b["correct"] for b in reference])
    new_share = statistics.mean(1 - (r["reused_exact"] + r["reused_moved"]) / r["prompt_tokens"] for r in rows)
    summary["cost_model_fraction"] = summary["recomputed_share_of_moved"] * doc_share + 2 / layers + new_share
    return summary


def run(questions: int, budget: int, seed: int = 0, ratios=RATIOS, model_name: str = "default",
        window_rule: bool = True, pool: int = 50) -> dict:
    model, tokenizer = load_model(model_name)
    docs, items = build(seed=seed, organisations=pool)
    items = items[:questions]
    configs = engines(model, tokenizer, budget, ratios, window_rule)
    for engine in configs.values():
        warm_up(engine, docs)
    results = {name: [] for name in configs}
    for i, question in enumerate(items):
        for name, engine in configs.items():
            results[name].append(ask(engine, question))
        if i % 20 == 0:
            print(f"question {i}: " + " ".join(f"{n}={int(r[-1]['correct'])}" for n, r in results.items()), flush=True)
    layers = len(model.model.layers)
    summaries = [summarise(name, rows, results["no-cache"], layers) for name, rows in results.items()]
    for rows in results.values():
        for row in rows:
            row.pop("logits")
    return {"benchmark": "moved_quality", "environment": environment(model, model_name), "seed": seed,
            "ratios": list(ratios), "questions": len(items), "window_rule": window_rule,
            "prompt_format": "chat" if getattr(tokenizer, "chat_template", None) else "few-shot completion",
            "summary": summaries, "answers": {n: [r["text"] for r in rows] for n, rows in results.items()}}


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = {s["config"]: s for s in result["summary"]}
    points = [("none", 0.0)] + [(f"blend-{r}", r) for r in result.get("ratios", RATIOS)] + [("full", 1.0)]
    xs = [x for _, x in points]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(xs, [rows[n]["accuracy"] for n, _ in points], "o-", label="moved reuse")
    left.axhline(rows["no-cache"]["accuracy"], color="gray", linestyle="--", label="no cache")
    left.set(xlabel="recompute ratio", ylabel="accuracy", title="Accuracy vs recompute ratio")
    left.legend()
    right.plot(xs, [rows[n]["median_ttft_speedup"] for n, _ in points], "o-", label="moved reuse")
    right.axhline(rows["exact"]["median_ttft_speedup"], color="gray", linestyle=":", label="exact-prefix only")
    right.axhline(1.0, color="gray", linestyle="--", label="no cache")
    right.set(xlabel="recompute ratio", ylabel="TTFT speedup over no cache (median)", title="TTFT vs recompute ratio")
    right.legend()
    fig.suptitle(f"{result['environment']['model']}, {result['questions']} questions, 5 documents each")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="default")
    parser.add_argument("--no-window-rule", action="store_true",
                        help="move whole spans on sliding-window models (EngineConfig.moved_window_rule=False)")
    parser.add_argument("--questions", type=int, default=200)
    parser.add_argument("--cache-gib", type=float, default=1.5)
    parser.add_argument("--seed", type=int, default=0,
                        help="QA set seed (0: the acceptance set; others: held-out sets of 200 more questions)")
    parser.add_argument("--ratios", default=",".join(map(str, RATIOS)),
                        help="blend recompute ratios to run, comma-separated (default %(default)s)")
    parser.add_argument("--pool", type=int, default=50, help="documents in the QA set (smaller: a quick smoke run)")
    parser.add_argument("--out", help="default benchmarks/results/moved_quality.json, or moved_quality_<model>.json")
    args = parser.parse_args(argv)
    ratios = tuple(float(r) for r in args.ratios.split(",") if r.strip())
    if not ratios or not all(0 < r < 1 for r in ratios):
        parser.error("--ratios: comma-separated values between 0 and 1 (exclusive)")
    result = run(args.questions, int(args.cache_gib * 2**30), args.seed, ratios, args.model, not args.no_window_rule,
                 args.pool)
    for s in result["summary"]:
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in s.items()}))
    suffix = "" if args.model == "default" else f"_{args.model}"
    out = Path(args.out or f"benchmarks/results/moved_quality{suffix}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
