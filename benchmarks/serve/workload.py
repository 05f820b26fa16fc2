"""The load test's requests, drawn from a seed (pure Python: client processes import it without torch).

Each stream of each client process gets its own list of `LoadRequest`s: chat turns (a system prompt
and a growing conversation), RAG questions (two documents of the QA set as document parts, then
the question), streams cancelled after their first deltas (`cancel`), and clients that give up
waiting for a reply and drop the connection (`disconnect`).
"""
from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

from ..data import qa

KINDS = ("chat", "rag", "cancel", "disconnect")
WEIGHTS = (0.4, 0.4, 0.1, 0.1)
SYSTEM = {"role": "system", "content": "You are a terse assistant. Answer in one short sentence, from the "
                                       "documents when there are any."}
CANCEL_AFTER_DELTAS = 2         # a cancelled stream is closed after this many text deltas
DISCONNECT_AFTER_S = 0.3        # a disconnecting client waits this long for a non-streamed reply


@dataclass(frozen=True)
class LoadRequest:
    """One request: its kind, OpenAI messages (document parts for RAG) and max_tokens."""

    kind: str
    messages: list
    max_tokens: int


def plan(seed: int, client: int, stream: int, requests: int, max_tokens: int = 24) -> list[LoadRequest]:
    """The requests of one stream (the same for a given seed, client and stream)."""
    docs, questions = qa.build(seed, organisations=20)
    rng = random.Random(f"{seed}-{client}-{stream}")
    history: list[dict] = []
    out = []
    for _ in range(requests):
        kind = rng.choices(KINDS, WEIGHTS)[0]
        question = rng.choice(questions).question
        if kind == "rag":
            parts = [{"type": "document", "text": d} for d in rng.sample(docs, 2)]
            out.append(LoadRequest(kind, [SYSTEM, {"role": "user", "content": [*parts, {"type": "text", "text": question}]}],
                                   max_tokens))
            continue
        if len(history) >= 6:
            history.clear()                             # a new conversation
        messages = [SYSTEM, *history, {"role": "user", "content": question}]
        out.append(LoadRequest(kind, messages, max_tokens if kind == "chat" else 4 * max_tokens))
        if kind == "chat":                              # the reply is not known ahead: a stand-in answer
            history += [{"role": "user", "content": question}, {"role": "assistant", "content": "I do not know."}]
    return out


def as_text(messages: list) -> list:
    """The messages with content parts joined as plain text (for a server that knows no document parts)."""
    def flat(content):
        if isinstance(content, str):
            return content
        return "\n\n".join(part["text"] for part in content)
    return [{**m, "content": flat(m["content"])} for m in messages]


def peak_rss_mib() -> float:
    """This process's peak resident memory in MiB (Linux VmHWM: unlike ru_maxrss, it does not carry the
    parent's peak over into a spawned process); 0 where /proc is missing."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def percentiles(values: list[float]) -> dict:
    """p50, p99, max (None when empty), rounded to milliseconds."""
    if not values:
        return {"p50": None, "p99": None, "max": None, "n": 0}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return {"p50": round(statistics.median(ordered), 3), "p99": round(p99, 3), "max": round(ordered[-1], 3),
            "n": len(ordered)}
