"""The remote benchmark's workloads, as LangChain messages both systems receive unchanged.

- chat: several conversations with the multi-turn benchmark's long system prompt (about 900
  tokens), turns interleaved across conversations (a seeded shuffle per round, as users arrive),
  scripted assistant replies, so both systems send the same conversation;
- chat-clock: the same with a first system-prompt line that changes with every request (the
  current time and a request id), as many apps write it;
- chat-docs: conversations that each open with documents of their own (a user's uploaded notes,
  three ~150-token documents) and go on about them: most of each prompt is per conversation,
  which is where routing matters;
- rag: questions over a pool of documents (benchmarks.data.qa), each with its document and
  distractors in a shuffled (retrieval) order: ours gets one document block per document; the
  peer gets them joined into the human message, as a stuff-documents chain sends them.

Every phase's prompts start with a tag of their own, so no phase hits the cache of another.
"""
from __future__ import annotations

import datetime
import random
import uuid
from dataclasses import dataclass

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

from kvboost_integrations.langchain import document_block

from ..data import qa as qa_data
from ..micro.multiturn import QUESTIONS as CHAT_QUESTIONS
from ..micro.multiturn import SYSTEM_PROMPT as CHAT_SYSTEM

RAG_SYSTEM = "Answer the question using only the documents. Reply with the answer only."
REPLY = ("Thanks for the question. Based on the product sheet, here is what applies to your case, "
         "with the figures quoted from the specification.")
CLOCK_START = datetime.datetime(2026, 11, 30, 9, 0, 0)


@dataclass(slots=True)
class Request:
    """One request: what ours is sent and what the peer is sent (the same conversation)."""

    label: str
    ours: list
    peer: list
    sequence: str               # the conversation or question set it belongs to
    answer: str = ""            # expected answer (rag), checked as a substring


def chat(conversations: int, turns: int, tag: str, clock: bool, seed: int = 0) -> list[Request]:
    """`conversations` x `turns` requests, interleaved; with `clock`, a changing first system line."""
    rng = random.Random(seed)
    histories = {c: [] for c in range(conversations)}
    requests, sent = [], 0
    for turn in range(turns):
        order = list(range(conversations))
        rng.shuffle(order)
        for c in order:
            question = CHAT_QUESTIONS[(c + turn) % len(CHAT_QUESTIONS)]
            if turn == 0:
                question = f"I am customer {c + 1}. {question}"
            histories[c].append(HumanMessage(question))
            system = f"[{tag}]\n{CHAT_SYSTEM}"
            if clock:
                now = CLOCK_START + datetime.timedelta(seconds=7 * sent)
                system = f"[{tag}]\nCurrent time: {now:%Y-%m-%d %H:%M:%S}. Request id: {uuid.UUID(int=rng.getrandbits(128))}\n{CHAT_SYSTEM}"
            messages = [SystemMessage(system), *histories[c]]
            requests.append(Request(f"conversation {c + 1} turn {turn + 1}", messages, messages, f"conversation {c + 1}"))
            histories[c].append(AIMessage(f"{REPLY} (turn {turn + 1})"))
            sent += 1
    return requests


def chat_docs(conversations: int, turns: int, tag: str, seed: int = 0) -> list[Request]:
    """Conversations opening with 3 documents of their own, then questions about them, interleaved."""
    docs, items = qa_data.build(seed=seed, organisations=3 * conversations, docs_per_question=1)
    rng = random.Random(seed)
    histories, requests = {}, []
    for turn in range(turns):
        order = list(range(conversations))
        rng.shuffle(order)
        for c in order:
            own = docs[3 * c:3 * c + 3]
            asked = [q for q in items if q.documents[0] in own]
            question = asked[turn % len(asked)].question
            if turn == 0:
                blocks = [{"type": "text", "text": "Here are my notes."}, *(document_block(d) for d in own)]
                histories[c] = [SystemMessage(f"[{tag}]\n{RAG_SYSTEM}"), HumanMessage([*blocks, {"type": "text", "text": question}])]
            else:
                histories[c].append(HumanMessage(question))
            messages = list(histories[c])
            requests.append(Request(f"conversation {c + 1} turn {turn + 1}", messages, _joined(messages),
                                    f"conversation {c + 1}", asked[turn % len(asked)].answer))
            histories[c].append(AIMessage(f"{REPLY} (turn {turn + 1})"))
    return requests


def _joined(messages: list) -> list:
    """The same messages with content blocks joined into strings (what a plain chain sends)."""
    return [type(m)("\n\n".join(b["text"] for b in m.content)) if isinstance(m.content, list) else m for m in messages]


def rag(questions: int, docs_per_question: int, pool: int, tag: str, seed: int = 0) -> list[Request]:
    """`questions` questions, each over `docs_per_question` documents from a pool of `pool`, shuffled."""
    _, items = qa_data.build(seed=seed, organisations=pool, docs_per_question=docs_per_question)
    system = f"[{tag}]\n{RAG_SYSTEM}"
    requests = []
    for i, item in enumerate(items[:questions]):
        question = f"Question: {item.question}"
        ours = [SystemMessage(system), HumanMessage([*(document_block(d) for d in item.documents),
                                                     {"type": "text", "text": question}])]
        peer = [SystemMessage(system), HumanMessage("\n\n".join([*item.documents, question]))]
        requests.append(Request(f"question {i + 1}", ours, peer, "questions", item.answer))
    return requests
