"""Quality and TTFT of moved reuse on a seeded multi-document QA set (default model).

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

Run: python -m benchmarks.research.moved_quality [--questions 200 --seed 0 --ratios 0.05,0.15,0.3 --out benchmarks/results/moved_quality.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from kvboost_engine import Engine

from .._common import chat_with_first_logits, environment, load_default
from ..data.qa import build

SYSTEM = "Answer the question using the documents. Reply with the answer only, in a few words."
RATIOS = (0.05, 0.15, 0.3)


def messages_for(documents, question: str) -> list[dict]:
    parts = [{"type": "document", "text": d} for d in documents] + [{"type": "text", "text": f"Question: {question}"}]
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": parts}]


def engines(model, tokenizer, budget: int, ratios=RATIOS) -> dict[str, Engine]:
    configs = {"no-cache": dict(cache_bytes=0), "exact": dict(moved_reuse="full"), "none": dict(moved_reuse="none")}
    configs.update({f"blend-{r}": dict(recompute_ratio=r) for r in ratios})
    configs["full"] = dict(recompute_ratio=1.0)
    return {name: Engine(model, tokenizer, **{"cache_bytes": budget, **opts}) for name, opts in configs.items()}


def warm_up(engine: Engine, docs: list[str]) -> None:
    for i in range(0, len(docs), 5):
        engine.chat(messages_for(docs[i:i + 5], "Which organisations are described?"), max_new_tokens=1)


def kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    p = torch.log_softmax(reference.double(), -1)
    q = torch.log_softmax(other.double(), -1)
    return float((p.exp() * (p - q)).sum())


def ask(engine: Engine, question) -> dict:
    g, logits = chat_with_first_logits(engine, messages_for(question.documents, question.question),
                                       max_new_tokens=12, stop=["\n"])
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


def run(questions: int, budget: int, seed: int = 0, ratios=RATIOS) -> dict:
    model, tokenizer = load_default()
    docs, items = build(seed=seed)
    items = items[:questions]
    configs = engines(model, tokenizer, budget, ratios)
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
    return {"benchmark": "moved_quality", "environment": environment(model), "seed": seed, "ratios": list(ratios), "questions": len(items),
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
    fig.suptitle(f"SmolLM2-135M, {result['questions']} questions, 5 documents each")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=int, default=200)
    parser.add_argument("--cache-gib", type=float, default=1.5)
    parser.add_argument("--seed", type=int, default=0,
                        help="QA set seed (0: the acceptance set; others: held-out sets of 200 more questions)")
    parser.add_argument("--ratios", default=",".join(map(str, RATIOS)),
                        help="blend recompute ratios to run, comma-separated (default %(default)s)")
    parser.add_argument("--out", default="benchmarks/results/moved_quality.json")
    args = parser.parse_args(argv)
    ratios = tuple(float(r) for r in args.ratios.split(",") if r.strip())
    if not ratios or not all(0 < r < 1 for r in ratios):
        parser.error("--ratios: comma-separated values between 0 and 1 (exclusive)")
    result = run(args.questions, int(args.cache_gib * 2**30), args.seed, ratios)
    for s in result["summary"]:
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in s.items()}))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
