"""Research harness: variants of blend's token selection on the moved-reuse QA set, each against
no cache in the same run (accuracy, agreement, first-token KL, TTFT speedup).

It swaps `Forward.scattered` for a version whose selection is set per variant, so alternatives
can be compared without changing the engine. Correct answers are also split by where the
answering document sits in the prompt and where it sat when first cached.

  layers  [[layer, ratio], ...]  check layers and the moved share kept after each (progressive
                                 narrowing); default [[check_layer, recompute_ratio]] = the engine's
  dev     "kv" (engine) | "k" | "v" | "kv-norm": which deviation ranks tokens
  query   share of the budget chosen by the attention the new tokens pay to moved tokens at the
          check layer (query-aware); the rest by deviation
  opts    Engine options (recompute_ratio, recompute_head_tokens, check_layer, moved_reuse...)
  alone   warm the cache with each document alone (default: five per prompt, as moved_quality)
  oracle  "patch" | "select": bounds, not methods. Each question is also prefilled in full (no
          cache) for its exact K/V, and moved tokens are ranked by `rank`. "patch" writes the exact
          K/V of the top share of moved tokens (the share of the first `layers` entry; layers
          `patch_layers` [lo, hi), default all) into the sequence and computes only the new
          tokens: what exact KV for those tokens gives (the target a recompute of them aims at).
          "select" runs blend's recompute with the oracle ranking in place of the check layer's
          deviation. TTFT of oracle variants includes the extra full prefill and means nothing.
  rank    oracle ranking: "deviation" (default): stale-vs-exact K/V deviation summed over all
          layers, each layer normalised to mean 1; or "attention": the attention the prompt's
          tokens after the last document pay to each moved token in the full prefill (summed
          over heads and those queries, each layer normalised to 1)
  target  "gold" | "distractors" (oracle "patch" only): patch every token of the answering
          document, or of the four others, instead of a ranked share

Run: python -m benchmarks.blend_variants --seed 1 '{}' '{"sel": {"dev": "v"}}' '{"alone": true}'
Not part of the test suite; the engine's selection is in kvboost_engine/blend.py.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

from kvboost_engine import Engine
from kvboost_engine import forward as forward_module
from kvboost_engine.attention import AttentionStep, ScatterStep
from kvboost_engine.kv import SequenceKV

from ._common import load_default
from .moved_quality import ask, kl, messages_for, paired_gap, warm_up
from .qa_data import build

_variant: dict = {}


class _Step(ScatterStep):
    __slots__ = ("mode", "query_mass", "new_tokens")

    def attend(self, layer, query, keys, values, scaling):
        measuring, self.measure = self.measure, False
        if measuring:
            cached_k, cached_v = self.kv.gather(layer, self.positions)
            dk = ((keys - cached_k) ** 2).sum((0, 1, 3))
            dv = ((values - cached_v) ** 2).sum((0, 1, 3))
            self.deviation = {"kv": dk + dv, "k": dk, "v": dv}.get(self.mode) if self.mode != "kv-norm" \
                else dk / dk.mean() + dv / dv.mean()
        out = super().attend(layer, query, keys, values, scaling)
        if measuring and self.new_tokens is not None and self.new_tokens.any():
            all_keys, _ = self.kv.gather(layer, torch.arange(self.end))
            all_keys = all_keys.repeat_interleave(query.shape[1] // all_keys.shape[1], 1)
            q_pos = self.positions[self.new_tokens]
            scores = (query[:, :, self.new_tokens] @ all_keys.transpose(-1, -2)) * scaling
            scores = scores.masked_fill(torch.arange(self.end)[None, :] > q_pos[:, None], float("-inf"))
            self.query_mass = torch.softmax(scores.float(), -1).sum((0, 1, 2))[self.positions]
        self.measure = measuring
        return out


def _choose(moved, head, score, budget):
    chosen = ~moved | head
    candidates = moved & ~head
    extra = max(0, budget - int((moved & head).sum()))
    if extra and candidates.any():
        ranked = torch.where(candidates, score.float(), torch.tensor(float("-inf")))
        chosen[torch.topk(ranked, min(extra, int(candidates.sum()))).indices] = True
    return chosen


@torch.inference_mode()
def _scattered(self, kv, token_ids, positions, end, selector=None):
    if selector is None:
        return _original(self, kv, token_ids, positions, end, None)
    a, sel = self.adapter, _variant.get("sel", {})
    schedule = dict((int(l), float(r)) for l, r in sel.get("layers", [[selector.layer, selector.ratio]]))
    oracle, exact = _oracle_score(self, kv, token_ids, positions, end, selector.moved) if "oracle" in sel else (None, None)
    if sel.get("oracle") == "patch":
        return _patch(self, kv, token_ids, positions, end, selector, oracle, exact, schedule[min(schedule)],
                      sel.get("patch_layers", [0, len(a.layers)]))
    moved, head = selector.moved.clone(), selector.head.clone()
    total = int(moved.sum())
    positions = positions.to(a.device)
    hidden = a.embed(torch.tensor(token_ids, dtype=torch.long, device=a.device)[positions][None])
    masks: dict = {}
    for layer in range(len(a.layers)):
        step = _Step(kv, positions, end, a.layer_windows, layer in schedule, masks)
        step.mode, step.query_mass = sel.get("dev", "kv"), None
        step.new_tokens = ~moved if layer in schedule and sel.get("query", 0) > 0 else None
        hidden = a.run_layer(layer, hidden, a.position_embeddings(hidden, positions[None]), positions[None], step)
        if layer in schedule:
            budget = math.ceil(schedule[layer] * total)
            if oracle is not None and layer == min(schedule):
                chosen = _choose(moved, head, oracle, budget)
            elif step.query_mass is not None:
                by_query = _choose(moved, head, step.query_mass, math.ceil(sel["query"] * budget) + int((moved & head).sum()))
                chosen = _choose(moved, head | by_query, step.deviation, budget)
            else:
                chosen = _choose(moved, head, step.deviation, budget)
            keep = torch.nonzero(chosen).flatten()
            hidden, positions, moved, head = hidden[:, keep], positions[keep], moved[keep], head[keep]
            masks = {}
    selector.recomputed_moved = int(moved.sum())
    return a.logits_last(hidden)


class _RecordingStep(AttentionStep):
    """A full prefill's attention step that also sums the attention queries from `q_from` on pay
    to every key (per layer: summed over heads and queries, normalised to total 1)."""
    __slots__ = ("q_from", "mass")

    def attend(self, layer, query, keys, values, scaling):
        out = super().attend(layer, query, keys, values, scaling)
        all_keys, _ = self.kv.view(layer, self.end)
        all_keys = all_keys.repeat_interleave(query.shape[1] // all_keys.shape[1], 1)
        scores = (query[:, :, self.q_from:] @ all_keys.transpose(-1, -2)) * scaling
        q_pos = torch.arange(self.q_from, self.end, device=scores.device)
        scores = scores.masked_fill(torch.arange(self.end, device=scores.device)[None, :] > q_pos[:, None], float("-inf"))
        probs = torch.softmax(scores.float(), -1).sum((0, 1, 2))
        self.mass += (probs / probs.sum()).cpu()
        return out


def _full_prefill(forward, token_ids, end, q_from):
    """Exact KV of the whole prompt, and the attention mass of queries from q_from on per position."""
    a = forward.adapter
    exact = SequenceKV(a.geometry, end, a.device)
    ids = torch.tensor([list(token_ids[:end])], dtype=torch.long, device=a.device)
    positions = torch.arange(end, device=a.device)[None]
    hidden = a.embed(ids)
    rope = a.position_embeddings(hidden, positions)
    step = _RecordingStep(exact, 0, end, a.layer_windows)
    step.q_from, step.mass = q_from, torch.zeros(end)
    for layer in range(len(a.layers)):
        hidden = a.run_layer(layer, hidden, rope, positions, step)
    return exact, step.mass


def _oracle_score(forward, kv, token_ids, positions, end, moved):
    """(score, exact KV): per active token, its oracle rank (0 for new tokens; all 0 with a
    `target`, which patches whole documents). By default the deviation of its stale K/V from a
    full prefill's, summed over layers (each layer normalised to mean 1 over moved tokens); with
    rank "attention", the attention mass it gets from the prompt's tokens after the last document."""
    a = forward.adapter
    moved_positions = positions.to(a.device)[moved.to(a.device)]
    exact, mass = _full_prefill(forward, token_ids, end, int(moved_positions.max()) + 1)
    score = torch.zeros(len(positions))
    if "target" in _variant["sel"]:                         # whole documents: no ranking needed
        return score, exact
    if _variant["sel"].get("rank") == "attention":
        score[moved.cpu()] = mass[moved_positions.cpu()]
        return score, exact
    for layer in range(len(a.layers)):
        (sk, sv), (fk, fv) = kv.gather(layer, moved_positions), exact.gather(layer, moved_positions)
        d = (((fk - sk) ** 2).sum((0, 1, 3)) + ((fv - sv) ** 2).sum((0, 1, 3))).float().cpu()
        score[moved.cpu()] += d / d.mean().clamp_min(1e-20)
    return score, exact


def _patch(forward, kv, token_ids, positions, end, selector, score, exact, ratio, patch_layers):
    """Exact K/V for the top `ratio` share of moved tokens, then the new tokens computed over it."""
    moved = selector.moved.cpu()
    target = _variant["sel"].get("target")
    if target is not None and _question is None:           # warm-up: no question, nothing patched
        chosen, k = positions[:0].cpu(), 0
    elif target is not None:
        gold = _document_positions(token_ids, _question.documents[_question.gold])
        in_gold = torch.isin(positions.cpu(), gold)
        chosen = positions.cpu()[moved & (in_gold if target == "gold" else ~in_gold)]
        k = len(chosen)
    else:
        k = math.ceil(ratio * int(moved.sum()))
        ranked = torch.where(moved, score, torch.tensor(float("-inf")))
        chosen = positions.cpu()[torch.topk(ranked, k).indices].sort().values if k else positions[:0]
    for layer in range(*patch_layers):
        fk, fv = exact.gather(layer, chosen)
        kv.write_at(layer, fk, fv, chosen)
    selector.recomputed_moved = k
    return _original(forward, kv, token_ids, positions.cpu()[~moved], end, None)


def _document_positions(token_ids, text: str) -> torch.Tensor:
    """Positions of a document's tokens in the prompt (found by its tokens without the two at
    each end, which may merge with the text around it)."""
    ids = _tokenizer.encode(text, add_special_tokens=False)
    core, prompt = ids[2:-2], list(token_ids)
    for i in range(len(prompt) - len(core) + 1):
        if prompt[i:i + len(core)] == core:
            return torch.arange(i - 2, i + len(core) + 2)
    raise ValueError("document not found in the prompt")


_question = None
_tokenizer = None
_original = forward_module.Forward.scattered


def main(argv=None) -> None:
    global _variant, _question, _tokenizer
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variants", nargs="+", help="JSON objects: {'sel': {...}, 'opts': {...}, 'alone': bool}")
    parser.add_argument("--seed", type=int, default=1, help="QA set seed (default 1: held out from moved_quality's 0)")
    parser.add_argument("--questions", type=int, default=200)
    parser.add_argument("--cache-gib", type=float, default=1.5)
    args = parser.parse_args(argv)
    try:
        variants = [_checked(json.loads(v)) for v in args.variants]
    except (ValueError, TypeError) as err:
        parser.error(f"variant: {err}")
    forward_module.Forward.scattered = _scattered
    model, tokenizer = load_default()
    _tokenizer = tokenizer
    docs, items = build(seed=args.seed)
    items = items[:args.questions]
    cold = Engine(model, tokenizer, cache_bytes=0)
    runs = []
    for variant in variants:
        engine = Engine(model, tokenizer, cache_bytes=int(args.cache_gib * 2**30), **variant.get("opts", {}))
        _variant = variant
        if variant.get("alone"):
            for doc in docs:
                engine.chat(messages_for([doc], "Which organisations are described?"), max_new_tokens=1)
        else:
            warm_up(engine, docs)
        runs.append((variant, engine, []))
    reference, started = [], time.time()
    for i, question in enumerate(items):
        _question = question
        reference.append(ask(cold, question))
        for variant, engine, rows in runs:
            _variant = variant
            rows.append(ask(engine, question))
        if i % 25 == 0:
            print(f"question {i}, {time.time() - started:.0f} s", flush=True)
    print(json.dumps({"variant": "no-cache", "accuracy": statistics.mean(r["correct"] for r in reference)}))
    for variant, _, rows in runs:
        pairs = list(zip(rows, reference))
        gap, gap_se = paired_gap([r["correct"] for r in rows], [b["correct"] for b in reference])
        print(json.dumps({
            "variant": variant, "accuracy": statistics.mean(r["correct"] for r in rows),
            "gap": round(gap, 4), "gap_se": round(gap_se, 4),
            "agreement": statistics.mean(r["text"] == b["text"] for r, b in pairs),
            "mean_kl_first_token": round(statistics.mean(kl(b["logits"], r["logits"]) for r, b in pairs), 4),
            "gained": sum(r["correct"] and not b["correct"] for r, b in pairs),
            "lost": sum(b["correct"] and not r["correct"] for r, b in pairs),
            "recomputed_share_of_moved": round(sum(r["recomputed"] for r in rows) / max(1, sum(r["reused_moved"] for r in rows)), 3),
            "median_ttft_speedup": round(statistics.median(b["ttft_s"] / r["ttft_s"] for r, b in pairs), 2),
            # correct answers split by where the answering document sits in the question's prompt,
            # and by where it sat when it was first cached (its place in its five-document warm-up
            # prompt; for `alone` variants the same grouping, though each document was cached alone)
            "correct_by_prompt_position": _split(rows, [q.gold for q in items]),
            "correct_by_cached_position": _split(rows, [docs.index(q.documents[q.gold]) % 5 for q in items])}),
            flush=True)
    print(json.dumps({"no-cache correct_by_prompt_position": _split(reference, [q.gold for q in items]),
                      "no-cache correct_by_cached_position": _split(reference, [docs.index(q.documents[q.gold]) % 5 for q in items]),
                      "questions_by_prompt_position": _split([{"correct": True}] * len(items), [q.gold for q in items])}))


def _checked(variant) -> dict:
    """A variant as parsed JSON, with unknown keys and values refused (a typo would run the default)."""
    if not isinstance(variant, dict) or set(variant) - {"sel", "opts", "alone"}:
        raise ValueError(f"expected an object with keys sel, opts, alone; got {variant!r}")
    sel = variant.get("sel", {})
    if not isinstance(sel, dict) or set(sel) - {"layers", "dev", "query", "oracle", "patch_layers", "rank", "target"}:
        raise ValueError(f"sel takes layers, dev, query, oracle, patch_layers, rank, target; got {sel!r}")
    if "patch_layers" in sel and not (isinstance(sel["patch_layers"], list) and len(sel["patch_layers"]) == 2
                                      and all(isinstance(v, int) for v in sel["patch_layers"])):
        raise ValueError(f"patch_layers must be [lo, hi] layer indices; got {sel['patch_layers']!r}")
    if sel.get("rank", "deviation") not in ("deviation", "attention"):
        raise ValueError(f"rank must be deviation or attention; got {sel['rank']!r}")
    if sel.get("target", "gold") not in ("gold", "distractors") or ("target" in sel and sel.get("oracle") != "patch"):
        raise ValueError(f"target must be gold or distractors, with oracle patch; got {sel!r}")
    if sel.get("oracle", "patch") not in ("patch", "select"):
        raise ValueError(f"oracle must be patch or select; got {sel['oracle']!r}")
    if "rank" in sel and "oracle" not in sel or "patch_layers" in sel and sel.get("oracle") != "patch":
        raise ValueError(f"rank needs an oracle, patch_layers the patch oracle; got {sel!r}")
    if sel.get("dev", "kv") not in ("kv", "k", "v", "kv-norm"):
        raise ValueError(f"dev must be kv, k, v or kv-norm; got {sel['dev']!r}")
    if not 0 <= sel.get("query", 0) <= 1:
        raise ValueError(f"query must be in [0, 1]; got {sel['query']!r}")
    return variant


def _split(rows: list[dict], keys: list[int]) -> list[int]:
    counts = [0] * 5
    for row, key in zip(rows, keys):
        counts[key] += bool(row["correct"])
    return counts


if __name__ == "__main__":
    main()
