"""Fixed English text for calibration and perplexity, with no download: CPython ships it.

`pydoc_data.topics` (the language reference behind `help()`) is part of every CPython
install. Calibration and evaluation use disjoint topics. Imports nothing but the stdlib, so
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


def calibration_texts(count: int = 64) -> list[str]:
    """`count` paragraphs (sorted topics, evaluation topics excluded) for quantization."""
    topics = _topics()
    out: list[str] = []
    for name in sorted(topics):
        if name in EVAL_TOPICS:
            continue
        out.extend(paragraphs(topics[name]))
        if len(out) >= count:
            break
    return out[:count]


def evaluation_text() -> str:
    """The fixed text perplexity is measured on (a few thousand words)."""
    topics = _topics()
    return "\n\n".join(" ".join(paragraphs(topics[name])) for name in EVAL_TOPICS)
