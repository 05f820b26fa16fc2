"""RAG helpers: retrieved Documents reach the model as one content block each.

One block per document makes each document its own cache segment, so its KV is reused
whenever it is retrieved again, whatever the question. Use them in place of a prompt
template that joins documents into one string:

```python
chain = retrieval_messages(retriever, system="Answer from the documents.") | ChatKVBoost()
chain.invoke("What does the warranty cover?")

# or, spelled out in LCEL
chain = {"context": retriever, "question": RunnablePassthrough()} | document_messages() | ChatKVBoost()
```

Chains that join documents into one string (create_stuff_documents_chain, a format_docs
join) still work unchanged; their documents are found by content-defined chunking instead.
"""
from __future__ import annotations

from collections.abc import Sequence

from langchain_core.documents import Document
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.prompt_values import ChatPromptValue
from langchain_core.runnables import Runnable, RunnableLambda, RunnableParallel, RunnablePassthrough

from .messages import document_block

DEFAULT_SYSTEM = ("Answer the question using only the documents below. "
                  "If they do not contain the answer, say that you don't know.")


def document_blocks(documents: Sequence[Document | str]) -> list[dict]:
    """One document content block per Document (its page_content) or string."""
    return [document_block(d.page_content if isinstance(d, Document) else str(d)) for d in documents]


def document_messages(system: str = DEFAULT_SYSTEM, *, question_key: str = "question", context_key: str = "context",
                      question_prefix: str = "Question: ") -> Runnable[dict, ChatPromptValue]:
    """A runnable: {question_key: str, context_key: [Document, ...]} -> chat messages.

    The messages are a system message, then one human message whose content is one block per
    document followed by the question.
    """
    def build(inputs: dict) -> ChatPromptValue:
        if not isinstance(inputs, dict) or question_key not in inputs or context_key not in inputs:
            raise ValueError(f"document_messages expects a dict with {question_key!r} and {context_key!r}")
        blocks = document_blocks(inputs[context_key])
        question = {"type": "text", "text": question_prefix + str(inputs[question_key])}
        return ChatPromptValue(messages=[SystemMessage(system), HumanMessage([*blocks, question])])

    return RunnableLambda(build, name="DocumentMessages")


def warm_documents(llm, documents: Sequence[Document | str], system: str = DEFAULT_SYSTEM) -> int:
    """Compute and cache each document where `document_messages(system)` will put it first: a later
    prompt with that document first reuses it exactly (with `ChatKVBoost(document_order="cache")`,
    any warmed document can go first). Call it at indexing time; returns the tokens cached."""
    texts = [d.page_content if isinstance(d, Document) else str(d) for d in documents]
    return llm.get_engine().warm_documents(texts, system=system)


def retrieval_messages(retriever: Runnable, system: str = DEFAULT_SYSTEM, **options) -> Runnable[str, ChatPromptValue]:
    """A runnable: question -> retrieve -> messages with one block per retrieved document."""
    gather = RunnableParallel({"context": retriever, "question": RunnablePassthrough()})
    return gather | document_messages(system, question_key="question", context_key="context", **options)
