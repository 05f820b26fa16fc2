"""Fixed English text for calibration and perplexity, with no download: CPython ships it.

`pydoc_data.topics` (the language reference behind `help()`) is part of every CPython
install. Calibration and evaluation use disjoint paragraphs. Imports nothing but the stdlib, so
scripts in other environments (the AutoAWQ reference run) can load this file by path.
"""
from __future__ import annotations

import re

EVAL_TOPICS = ("assignment", "class", "function", "if", "while")


def _topics() -> dict[str, str]:
    from pydoc_data.topics import topics
    return topics


def paragraphs(text: str, min_chars: int = 200) -> list[str]:
    """Blank-line separated paragraphs, whitespace collapsed, short ones dropped."""
    parts = (re.sub(r"\s+", " ", p).strip() for p in re.split(r"\n\s*\n", text))
    return [p for p in parts if len(p) >= min_chars]


def calibration_texts(count: int | None = None) -> list[str]:
    """Paragraphs for quantization, interleaved across topics (the first paragraph of every
    topic, then every second one, ...) so any prefix covers them all. Evaluation topics are
    excluded, and so is any paragraph the evaluation text contains: topics overlap (e.g.
    "augassign" repeats part of "assignment"). `count` limits how many (None: all, about 60k
    tokens of SmolLM2's tokenizer)."""
    topics = _topics()
    held_out = evaluation_text()
    per_topic = [[p for p in paragraphs(topics[name]) if p not in held_out]
                 for name in sorted(topics) if name not in EVAL_TOPICS]
    out = [topic[i] for i in range(max(map(len, per_topic))) for topic in per_topic if i < len(topic)]
    return out if count is None else out[:count]


def evaluation_text() -> str:
    """The fixed text perplexity is measured on (a few thousand words)."""
    topics = _topics()
    return "\n\n".join(" ".join(paragraphs(topics[name])) for name in EVAL_TOPICS)
