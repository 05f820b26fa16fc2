"""How much of a joined-string prompt's document text the content index finds again.

An unmodified LangChain "stuff" chain or LlamaIndex synthesizer sends the retrieved documents
joined into one string, with no document parts. The engine then finds documents only through
content-defined cuts and 16-token anchors. This benchmark sends the held-out QA set that way:
each question's five documents joined by blank lines in a new order, then the question, all one
user string. Before the questions, every document is seen once (--regime):
  alone    each document alone, as the whole user message after another system prompt
  groups   five documents per warm-up prompt, joined the same way, in other orders
Reported: the share of document tokens the request reused (exact prefix or moved), over all
questions and per question (median, 10th percentile): the tokens reused beyond the system prompt,
at most the documents' tokens; and a lower bound that counts every other reused token (glue,
separators, question) as not a document token. Moved reuse has to be on for a moved span
to be reused at all (`moved_reuse="none"`: found spans are re-rotated, nothing recomputed); the
default `moved_reuse="full"` finds the same spans and recomputes them.

Gemma 3 270M (--model gemma3-270m, no chat template) gets the same text as one plain prompt
through `engine.generate`; the window rule is off so that found spans count as reused.

Run: python -m benchmarks.micro.joined_reuse [--regime alone --model default --questions 200 --seed 1]
"""
from __future__ import annotations

import argparse
import json
import statistics

from kvboost_engine import Engine

from .._common import MODELS, environment, load_model, save_result
from ..data.qa import build

SYSTEM = "Answer the question using the documents. Reply with the answer only, in a few words."


def joined(documents, question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "\n\n".join(documents) + f"\n\nQuestion: {question}"}]


def document_tokens(ids: list[int], documents, tokenizer) -> list[tuple[int, int]]:
    """[start, end) of each document's tokens in the prompt (tokenized alone, found verbatim; a
    document whose first or last token merged with its neighbour is matched without it)."""
    spans = []
    for doc in documents:
        doc_ids = tokenizer(doc, add_special_tokens=False)["input_ids"]
        for trim in ((0, 0), (1, 0), (0, 1), (1, 1)):
            inner = doc_ids[trim[0]:len(doc_ids) - trim[1]]
            at = next((i for i in range(len(ids) - len(inner) + 1) if ids[i:i + len(inner)] == inner), None)
            if at is not None:
                spans.append((at, at + len(inner)))
                break
        else:
            raise RuntimeError("a document's tokens were not found in the prompt")
    return spans


def ask(engine: Engine, documents, question: str):
    """Send one question; returns (generation, prompt ids, tokens of the head before the documents).
    Models without a chat template get the same text as one plain prompt through `generate`."""
    if getattr(engine.tokenizer, "chat_template", None):
        messages = joined(documents, question)
        head = len(engine.encode_messages(messages[:1], add_generation_prompt=False).token_ids)
        return engine.chat(messages, max_new_tokens=1), engine.encode_messages(messages).token_ids, head
    text = f"{SYSTEM}\n\n" + "\n\n".join(documents) + f"\n\nQuestion: {question}\nAnswer:"
    head = len(engine.encode_prompt(f"{SYSTEM}\n\n").token_ids)
    return engine.generate(text, max_new_tokens=1), engine.encode_prompt(text).token_ids, head


def run(regime: str, questions: int, seed: int, model_name: str = "default") -> dict:
    model, tokenizer = load_model(model_name)
    docs, items = build(seed=seed)
    items = items[:questions]
    engine = Engine(model, tokenizer, moved_reuse="none", moved_window_rule=False)
    chat = bool(getattr(tokenizer, "chat_template", None))
    if regime == "alone":
        for doc in docs:
            if chat:
                engine.chat([{"role": "system", "content": "Summarise the document in one line."},
                             {"role": "user", "content": doc}], max_new_tokens=1)
            else:
                engine.generate(f"Summarise the document in one line.\n\n{doc}\nSummary:", max_new_tokens=1)
    else:
        for i in range(0, len(docs), 5):
            ask(engine, docs[i:i + 5][::-1], "Which organisations are described?")
    shares, doc_total, reused_total, lower_total = [], 0, 0, 0
    for question in items:
        g, ids, system_tokens = ask(engine, question.documents, question.question)
        in_docs = sum(end - start for start, end in document_tokens(ids, question.documents, tokenizer))
        beyond_system = max(0, g.reused_exact - system_tokens) + g.reused_moved
        reused_docs = min(in_docs, beyond_system)
        shares.append(reused_docs / in_docs)
        doc_total += in_docs
        reused_total += reused_docs
        lower_total += max(0, beyond_system - (len(ids) - system_tokens - in_docs))
    deciles = statistics.quantiles(shares, n=10)
    return {"benchmark": "joined_reuse", "regime": regime, "seed": seed, "questions": len(items),
            "environment": environment(model, model_name), "document_tokens": doc_total,
            "reused_document_share": reused_total / doc_total,
            "reused_document_share_lower_bound": lower_total / doc_total, "median_question_share": statistics.median(shares),
            "p10_question_share": deciles[0], "questions_at_or_over_90": sum(s >= 0.9 for s in shares)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--regime", choices=("alone", "groups"), default="alone")
    parser.add_argument("--model", choices=sorted(MODELS), default="default")
    parser.add_argument("--questions", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1, help="QA set seed (1: held-out set)")
    parser.add_argument("--out", default=None, help="default benchmarks/results/joined_reuse_<regime>.json")
    args = parser.parse_args(argv)
    result = run(args.regime, args.questions, args.seed, args.model)
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items() if k != "environment"}))
    save_result(result, args.out, f"joined_reuse_{args.regime}", args.model)


if __name__ == "__main__":
    main()
