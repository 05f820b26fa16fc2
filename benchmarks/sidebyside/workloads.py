"""The three side-by-side workloads as plain data: sequences of chat requests.

- chat: a replay of one generated conversation (the system prompt and questions of
  benchmarks.multiturn; the assistant turns are plain transformers' own greedy replies, fixed
  once, so every system sees the very same prompts).
- rag: seeded multi-document QA (benchmarks.qa_data) over a pool of documents; for each number
  of documents per question, a sequence of questions whose documents come back in new orders.
- coding: a coding-assistant session (benchmarks.coding_data): long system prompt, project
  files, questions; a file is edited half-way and the files are reordered later.

Documents and files are content parts of type "document"; `flat_messages` joins the parts of a
message into one string (the same text our engine renders), which is what every system
without document structure receives. A model without a chat template (Gemma 3 270M, a base
model) gets each request as a plain-text transcript instead (`transcript`, `transcript_text`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from ..data import coding as coding_data
from ..data import qa as qa_data
from ..research.moved_quality import messages_for
from ..micro.multiturn import QUESTIONS as CHAT_QUESTIONS
from ..micro.multiturn import SYSTEM_PROMPT as CHAT_SYSTEM

PART_SEPARATOR = "\n\n"        # kvboost_engine.prompt.PART_SEPARATOR: how parts join into one message text
RAG_POOL = 10                  # documents in the RAG pool; every question draws its documents from it


@dataclass(slots=True)
class Request:
    messages: list[dict]       # OpenAI-style; user content is a string or a list of text/document parts
    label: str                 # what this request is in its sequence: "turn 3", "question 2", "step 4"
    answer: str = ""           # the expected answer (rag), checked as a substring of the reply
    event: str = ""            # what changed in the context at this request (coding)


@dataclass(slots=True)
class Sequence:
    """Requests answered in order from an empty cache (each system is reset before it)."""
    key: str                   # "conversation", "docs=4", "session"
    requests: list[Request]
    x: int = 0                 # the numeric parameter of the sequence (documents per question)


@dataclass(slots=True)
class Workload:
    name: str                  # "chat", "rag", "coding"
    title: str
    max_new_tokens: int
    sequences: list[Sequence] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)

    def describe(self) -> dict:
        """What a results file keeps of the workload: no prompts (the code rebuilds them), but the
        labels, events, expected answers and, for chat, the replayed assistant turns."""
        out = {"name": self.name, "title": self.title, "max_new_tokens": self.max_new_tokens, "sequences": []}
        for seq in self.sequences:
            requests = [{"label": r.label, "event": r.event, "answer": r.answer} for r in seq.requests]
            out["sequences"].append({"key": seq.key, "x": seq.x, "requests": requests})
        if self.name == "chat":
            last = self.sequences[0].requests[-1].messages
            out["replayed_replies"] = [m["content"] for m in last if m["role"] == "assistant"]
        return out

    @classmethod
    def from_json(cls, data: dict) -> "Workload":
        seqs = [Sequence(s["key"], [Request(**r) for r in s["requests"]], s["x"]) for s in data["sequences"]]
        return cls(data["name"], data["title"], data["max_new_tokens"], seqs)


def flat_messages(messages: list[dict]) -> list[dict]:
    """Every message's parts joined into one string: the prompt of a system without document parts."""
    return [{**m, "content": m["content"] if isinstance(m["content"], str)
             else PART_SEPARATOR.join(part["text"] for part in m["content"])} for m in messages]


def transcript(messages: list[dict]) -> list[dict]:
    """A conversation as plain-text segments, for a base model without a chat template: the system
    prompt, then "User: ..." and "Assistant: ..." lines (a message of parts starts them on the
    next line), ending with "Assistant:". Documents stay their own segments (our engine finds
    them again wherever they land); `transcript_text` joins the same segments into the one string
    every other system receives. Segments split where the tokenizer splits the joined text, so
    both give the same tokens."""
    out: list[dict] = []
    for m in messages:
        content = m["content"]
        if m["role"] == "system":
            out.append({"text": f"{content}\n\n", "kind": "system"})
            continue
        label = "User" if m["role"] == "user" else "Assistant"
        if isinstance(content, str):            # the space goes with the text: " How" is one token, as in the flat text
            out += [{"text": f"{label}:", "kind": "glue"}, {"text": f" {content}", "kind": m["role"]}]
        else:                                   # parts start on their own line, wherever they are
            out.append({"text": f"{label}:\n", "kind": "glue"})
            for i, part in enumerate(content):
                if i:
                    out.append({"text": PART_SEPARATOR, "kind": "glue"})
                kind = "document" if part["type"] == "document" else m["role"]
                out.append({"text": part["text"], "kind": kind})
        out.append({"text": "\n", "kind": "glue"})
    out.append({"text": "Assistant:", "kind": "glue"})
    return out


def transcript_text(messages: list[dict]) -> str:
    return "".join(segment["text"] for segment in transcript(messages))


def chat_workload(turns: int, max_new_tokens: int, reply: Callable[[list[dict]], str]) -> Workload:
    """One conversation of `turns` turns; `reply(messages)` writes each assistant turn (plain transformers)."""
    if turns > len(CHAT_QUESTIONS):
        raise ValueError(f"at most {len(CHAT_QUESTIONS)} turns")
    messages = [{"role": "system", "content": CHAT_SYSTEM}]
    requests = []
    for turn, question in enumerate(CHAT_QUESTIONS[:turns], 1):
        messages = messages + [{"role": "user", "content": question}]
        requests.append(Request(messages, f"turn {turn}"))
        messages = messages + [{"role": "assistant", "content": reply(messages)}]
    return Workload("chat", f"Multi-turn chat ({turns} turns, replayed)", max_new_tokens,
                    [Sequence("conversation", requests, turns)])


def rag_workload(doc_counts: tuple[int, ...], questions: int, max_new_tokens: int, seed: int = 0) -> Workload:
    """For each k in doc_counts: `questions` questions, each with its document and k-1 distractors
    from a pool of RAG_POOL documents, shuffled, so documents recur at other positions."""
    sequences = []
    for k in doc_counts:
        _, items = qa_data.build(seed=seed, organisations=RAG_POOL, docs_per_question=k)
        requests = [Request(messages_for(q.documents, q.question), f"question {i + 1}", q.answer)
                    for i, q in enumerate(items[:questions])]
        sequences.append(Sequence(f"docs={k}", requests, k))
    return Workload("rag", f"RAG, shuffled retrieved documents (pool of {RAG_POOL})", max_new_tokens, sequences)


def coding_workload(steps: int, max_new_tokens: int) -> Workload:
    """A session of `steps` questions over the project files (edit and reorder on the way)."""
    requests = []
    for step, question in enumerate(coding_data.QUESTIONS[:steps]):
        parts = [{"type": "document", "text": coding_data.file_part(path, text)}
                 for path, text in coding_data.project_files(step)]
        parts.append({"type": "text", "text": question})
        messages = [{"role": "system", "content": coding_data.SYSTEM}, {"role": "user", "content": parts}]
        requests.append(Request(messages, f"step {step + 1}", event=coding_data.event_at(step)))
    return Workload("coding", "Coding assistant (system prompt + project files)", max_new_tokens,
                    [Sequence("session", requests, steps)])
