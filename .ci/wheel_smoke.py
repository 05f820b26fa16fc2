"""Smoke test of an installed kvboost wheel (run from outside the checkout, in a fresh venv).

    python wheel_smoke.py langchain      # one chat and one LCEL chain with ChatKVBoost
    python wheel_smoke.py llama-index    # one chat and one query engine with KVBoost

Uses the default model (fetched and converted on first use, or from $KVBOOST_DEFAULT_GGUF).
Exits non-zero on any failure; prints what it got and how long it took.
"""
from __future__ import annotations

import sys
import time

DOCS = ["The Zorblat river flows north through the town of Quennel.",
        "Quennel is famous for its blue cheese market held every Tuesday.",
        "The lighthouse of Marrow Point was built in 1874."]
QUESTION = "Which day is the cheese market in Quennel?"


def check_installed_not_checkout() -> None:
    import kvboost_engine
    assert "site-packages" in kvboost_engine.__file__, f"not the installed wheel: {kvboost_engine.__file__}"


def langchain() -> None:
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate
    from kvboost_integrations.langchain import ChatKVBoost

    chat = ChatKVBoost(max_tokens=12)
    reply = chat.invoke("Say hello in one word.")
    assert isinstance(reply.content, str) and reply.content.strip(), reply
    print("chat:", repr(reply.content))
    prompt = ChatPromptTemplate.from_messages([("system", "Answer from the context.\n\nContext:\n{context}"),
                                               ("human", "{question}")])
    chain = prompt | chat | StrOutputParser()
    answers = [chain.invoke({"context": "\n".join(DOCS), "question": QUESTION}) for _ in range(2)]
    assert all(a.strip() for a in answers) and answers[0] == answers[1], answers
    print("LCEL chain:", repr(answers[0]))


def llama_index() -> None:
    from llama_index.core import Document, Settings, SummaryIndex
    from llama_index.core.llms import ChatMessage
    from kvboost_integrations.llama_index import KVBoost

    llm = KVBoost(max_new_tokens=12)
    reply = llm.chat([ChatMessage(role="user", content="Say hello in one word.")])
    assert reply.message.content.strip(), reply
    print("chat:", repr(reply.message.content))
    Settings.llm = llm
    engine = SummaryIndex.from_documents([Document(text=t) for t in DOCS]).as_query_engine(llm=llm)
    answer = str(engine.query(QUESTION))
    assert answer.strip(), answer
    print("query engine:", repr(answer))


def main(which: str) -> None:
    started = time.time()
    check_installed_not_checkout()
    {"langchain": langchain, "llama-index": llama_index}[which]()
    print(f"{which} wheel smoke passed in {time.time() - started:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1])
