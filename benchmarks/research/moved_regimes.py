"""Moved documents in the warm-up regimes real apps produce: accuracy, agreement and TTFT of the
default (exact reuse only), cache-aware order, and the opt-in moved repairs, each against no cache.

Regimes (how the documents got into the cache before the questions):
  alone    each document first seen alone, in another prompt with another system prompt (the least
           friendly: its KV was computed after text that never comes back)
  groups   five documents per warm-up prompt, under the questions' system prompt
  earlier  no warm-up: documents cached by earlier questions, in other orders
  shared   each document warmed alone right after the questions' system prompt (APE / CacheFocus:
           every document behind one shared prefix; what Engine.warm_documents does)
Configurations (--configs, comma-separated):
  exact          the engine default: exact-prefix reuse only (replies identical to no cache)
  cache-order    exact, with Engine.order_documents (cached sequences first; the reference keeps
                 relevance order, so this is measured against no cache in relevance order)
  none           moved reuse, keys re-rotated, nothing recomputed
  blend-R        blend, the R share of moved tokens by KV deviation (CacheBlend), 4 head tokens
  head-K         blend 0.15 with the first K tokens of every moved span recomputed (EPIC)
  attention-R    blend, the R share of moved tokens the question attends to most (ProphetKV-style
                 probe through the first 8 layers)
Every configuration is its own engine on the same model; questions run interleaved over them.
Reported per configuration: accuracy, its gap to no cache with the paired standard error, agreement
of the greedy reply with no cache's, mean first-token KL, reuse shares, TTFT speedup over no cache.

Models: the default (chat prompts) or Gemma 3 270M (--model gemma3-270m: the base model's few-shot
completion prompt of moved_quality, documents as "document" segments; --no-window-rule lets moved
reuse move documents shorter than its 512-token window, which the engine otherwise recomputes).

Run: python -m benchmarks.research.moved_regimes --regime alone [--model default --questions 200 --seed 1
     --configs exact,cache-order,none,blend-0.15,blend-0.3,head-16,head-32,attention-0.15]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

from kvboost_engine import Engine

from .._common import MODELS, environment, load_model, save_result
from ..data.qa import build
from .moved_quality import FEW_SHOT, SYSTEM, ask, completion_for, kl, messages_for, paired_gap, request

REGIMES = ("alone", "groups", "earlier", "shared")
DEFAULT_CONFIGS = "exact,cache-order,none,blend-0.15,blend-0.3,head-16,head-32,attention-0.15"


def config_options(name: str, window_rule: bool = True) -> dict:
    """Engine options of a configuration name."""
    if name in ("exact", "cache-order"):
        return {}
    moved = {"moved_window_rule": window_rule}
    if name == "none":
        return {"moved_reuse": "none", **moved}
    kind, _, value = name.partition("-")
    if kind == "blend":
        return {"moved_reuse": "blend", "recompute_ratio": float(value), **moved}
    if kind == "head":
        return {"moved_reuse": "blend", "recompute_ratio": 0.15, "recompute_head_tokens": int(value), **moved}
    if kind == "attention":
        return {"moved_reuse": "blend", "recompute_ratio": float(value), "moved_selection": "attention",
                "check_layer": 7, **moved}
    raise ValueError(f"unknown configuration {name!r}")


def chat_format(engine: Engine) -> bool:
    return bool(getattr(engine.tokenizer, "chat_template", None))


def warm(engine: Engine, regime: str, docs: list[str]) -> None:
    chat = chat_format(engine)
    if regime == "alone":
        for doc in docs:
            if chat:
                engine.chat([{"role": "system", "content": "Summarise the document in one line."},
                             {"role": "user", "content": [{"type": "document", "text": doc}]}], max_new_tokens=1)
            else:
                engine.generate([{"text": "Summarise the document in one line.\n\n", "kind": "system"},
                                 {"text": f"Document: {doc}\n", "kind": "document"},
                                 {"text": "Summary:", "kind": "text"}], max_new_tokens=1)
    elif regime == "groups":
        for i in range(0, len(docs), 5):
            request(engine, docs[i:i + 5], "Which organisations are described?", max_new_tokens=1)
    elif regime == "shared":
        if chat:
            engine.warm_documents(docs, system=SYSTEM)
        else:
            for doc in docs:
                engine.generate([{"text": FEW_SHOT, "kind": "system"},
                                 {"text": f"Document: {doc}\n", "kind": "document"}], max_new_tokens=1)


def ask_config(name: str, engine: Engine, question) -> dict:
    if name != "cache-order":
        return ask(engine, question)
    if chat_format(engine):
        ordered, placed = engine.order_documents(messages_for(question.documents, question.question))
        documents = tuple(p["text"] for p in ordered[1]["content"] if p["type"] == "document")
    else:
        ordered, placed = engine.order_documents(completion_for(question.documents, question.question))
        documents = tuple(s["text"][len("Document: "):-1] for s in ordered if s["kind"] == "document")
    gold = documents.index(question.documents[question.gold])
    row = ask(engine, dataclasses.replace(question, documents=documents, gold=gold))
    row["documents_from_cache"] = placed
    return row


def summarise(name: str, rows: list[dict], reference: list[dict]) -> dict:
    gap, gap_se = paired_gap([r["correct"] for r in rows], [b["correct"] for b in reference])
    summary = {
        "config": name, "accuracy": statistics.mean(r["correct"] for r in rows), "accuracy_gap": gap,
        "accuracy_gap_se": gap_se,
        "agreement_with_no_cache": statistics.mean(r["text"] == b["text"] for r, b in zip(rows, reference)),
        "mean_kl_first_token": statistics.mean(kl(b["logits"], r["logits"]) for r, b in zip(rows, reference)),
        "exact_share": statistics.mean(r["reused_exact"] / r["prompt_tokens"] for r in rows),
        "moved_share": statistics.mean(r["reused_moved"] / r["prompt_tokens"] for r in rows),
        "recomputed_share_of_moved": sum(r["recomputed"] for r in rows) / max(1, sum(r["reused_moved"] for r in rows)),
        "median_ttft_s": statistics.median(r["ttft_s"] for r in rows),
        "median_ttft_speedup": statistics.median(b["ttft_s"] / r["ttft_s"] for r, b in zip(rows, reference)),
    }
    if "documents_from_cache" in rows[0]:
        summary["documents_from_cache_per_question"] = statistics.mean(r["documents_from_cache"] for r in rows)
    return summary


def run(regime: str, configs: list[str], questions: int, seed: int, budget: int, deadline_s: float | None = None,
        model_name: str = "default", window_rule: bool = True) -> dict:
    """Every configuration on the first `questions` questions; with `deadline_s`, no new question starts
    after that many seconds, and the result counts the questions asked."""
    started = time.monotonic()
    model, tokenizer = load_model(model_name)
    docs, items = build(seed=seed)
    items = items[:questions]
    engines = {"no-cache": Engine(model, tokenizer, cache_bytes=0)}
    engines.update({name: Engine(model, tokenizer, cache_bytes=budget, **config_options(name, window_rule))
                    for name in configs})
    for name, engine in engines.items():
        if name != "no-cache":
            warm(engine, regime, docs)
    results = {name: [] for name in engines}
    for i, question in enumerate(items):
        if deadline_s is not None and time.monotonic() - started > deadline_s:
            print(f"[{regime}] deadline reached after {i} questions", flush=True)
            break
        for name, engine in engines.items():
            results[name].append(ask_config(name, engine, question))
        if i % 20 == 0:
            print(f"[{regime}] question {i}: " + " ".join(f"{n}={int(r[-1]['correct'])}" for n, r in results.items()),
                  flush=True)
    summaries = [summarise(name, rows, results["no-cache"]) for name, rows in results.items()]
    for rows in results.values():
        for row in rows:
            row.pop("logits")
    return {"benchmark": "moved_regimes", "regime": regime, "environment": environment(model, model_name),
            "seed": seed, "window_rule": window_rule, "wall_s": round(time.monotonic() - started, 1),
            "prompt_format": "chat" if getattr(tokenizer, "chat_template", None) else "few-shot completion",
            "questions": len(results["no-cache"]), "questions_asked_for": len(items), "summary": summaries}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--regime", choices=REGIMES, required=True)
    parser.add_argument("--model", choices=sorted(MODELS), default="default")
    parser.add_argument("--no-window-rule", action="store_true",
                        help="move whole spans on sliding-window models (EngineConfig.moved_window_rule=False)")
    parser.add_argument("--configs", default=DEFAULT_CONFIGS)
    parser.add_argument("--questions", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1, help="QA set seed (1: held-out set)")
    parser.add_argument("--cache-gib", type=float, default=1.5)
    parser.add_argument("--out", default=None, help="default benchmarks/results/moved_regimes_<regime>.json")
    parser.add_argument("--deadline-min", type=float, default=None,
                        help="start no new question after this many minutes (the result says how many were asked)")
    args = parser.parse_args(argv)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for name in configs:
        config_options(name)                                # refuse typos before loading anything
    deadline = None if args.deadline_min is None else args.deadline_min * 60
    result = run(args.regime, configs, args.questions, args.seed, int(args.cache_gib * 2**30), deadline, args.model,
                 not args.no_window_rule)
    for s in result["summary"]:
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in s.items()}))
    save_result(result, args.out, f"moved_regimes_{args.regime}", args.model)


if __name__ == "__main__":
    main()
