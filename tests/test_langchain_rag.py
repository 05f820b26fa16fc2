"""End-to-end RAG: an in-memory vector store with a deterministic offline embedding, a retriever,
and (a) our block-per-document chain, (b) an unmodified create_retrieval_chain.

The questions retrieve overlapping documents in different orders: answers identical to the
cache-off chain where the reuse is exact, and full reuse of documents that arrive again in the
same order.
"""
import math
import re
import zlib

import pytest

pytest.importorskip("langchain_core")

from langchain_core.callbacks import BaseCallbackHandler  # noqa: E402
from langchain_core.documents import Document  # noqa: E402
from langchain_core.embeddings import Embeddings  # noqa: E402
from langchain_core.vectorstores import InMemoryVectorStore  # noqa: E402

from kvboost_engine import Engine  # noqa: E402
from kvboost_integrations.langchain import ChatKVBoost, retrieval_messages  # noqa: E402
from kvboost_integrations.langchain.messages import to_engine_messages  # noqa: E402

CORPUS = [
    "The Orion kettle boils a full litre of water in ninety seconds and switches itself off when the jug is "
    "empty. Its warranty covers the heating element and the thermostat for two years from the date of purchase.",
    "The Orion toaster has four wide slots, a defrost setting and a crumb tray that slides out for cleaning. Its "
    "warranty covers the heating element for one year; the crumb tray is not covered.",
    "The Vega blender crushes ice with a nine hundred watt motor. The glass jug is dishwasher safe, and the "
    "warranty on the motor lasts three years if the blender is registered online.",
    "The Vega coffee grinder offers twelve grind settings and a quiet motor that stops when the lid opens. Its "
    "warranty covers the motor for two years and the burrs for six months.",
    "Returns are accepted within thirty days of delivery when the product is unused and in its original box. "
    "Refunds reach the original payment method within five working days.",
    "Shipping is free for orders above fifty euros. Express delivery arrives the next working day when the "
    "order is placed before noon, and parcels can be collected at any pickup point.",
]
QUESTIONS = [
    "What does the warranty of the Orion kettle cover?",
    "How long is the warranty on the heating element of the Orion toaster?",
    "Is the Orion kettle warranty longer than the Orion toaster warranty?",
    "Is the toaster heating element covered as long as the blender motor?",
]
SYSTEM = "Answer in one short sentence using only the documents."
_WORD = re.compile(r"[a-z0-9]+")
_STOP = {"the", "a", "an", "of", "is", "and", "on", "for", "in", "its", "when", "what", "how", "to", "than", "or"}


class WordHashEmbeddings(Embeddings):
    """Deterministic, offline bag-of-words embedding (hashed word counts, L2-normalised)."""

    dims = 1024

    def _embed(self, text: str) -> list[float]:
        vector = [0.0] * self.dims
        for word in _WORD.findall(text.lower()):
            if word not in _STOP:
                vector[zlib.crc32(word.encode()) % self.dims] += 1.0
        norm = math.sqrt(sum(v * v for v in vector)) or 1.0
        return [v / norm for v in vector]

    def embed_documents(self, texts):
        return [self._embed(t) for t in texts]

    def embed_query(self, text):
        return self._embed(text)


class MetadataRecorder(BaseCallbackHandler):
    """Collects the response metadata of every chat-model call in a chain."""

    def __init__(self):
        self.metadata = []

    def on_llm_end(self, response, **kwargs):
        self.metadata.append(response.generations[0][0].message.response_metadata)


@pytest.fixture(scope="module")
def retriever():
    store = InMemoryVectorStore(WordHashEmbeddings())
    store.add_documents([Document(page_content=text, id=str(i)) for i, text in enumerate(CORPUS)])
    return store.as_retriever(search_kwargs={"k": 3})


@pytest.fixture(scope="module")
def retrieved(retriever):
    orders = [[d.page_content for d in retriever.invoke(q)] for q in QUESTIONS]
    assert len({tuple(o) for o in orders}) == len(orders)              # a different order each time
    assert all(set(o) & set(orders[0]) for o in orders[1:])            # ... of overlapping documents
    return orders


def _engine(smol, cache_bytes, **options):
    model, tokenizer = smol
    return Engine(model, tokenizer, cache_bytes=cache_bytes, model_name="SmolLM2-135M-Instruct", **options)


@pytest.fixture(scope="module")
def block_chain_runs(smol, retriever, retrieved):
    """(a): answers and metadata with moved reuse on (opt-in), with the defaults, and with the cache off."""
    runs = {}
    for name, cache_bytes, options in (("moved", 256 * 2**20, {"moved_reuse": "blend"}),
                                       ("default", 256 * 2**20, {}), ("cold", 0, {})):
        chain = retrieval_messages(retriever, system=SYSTEM) | ChatKVBoost(engine=_engine(smol, cache_bytes, **options),
                                                                          max_tokens=8)
        runs[name] = [chain.invoke(q) for q in QUESTIONS]
    return runs


def test_block_chain_with_default_settings_answers_exactly_like_the_cache_off_chain(block_chain_runs):
    default, cold = block_chain_runs["default"], block_chain_runs["cold"]
    assert [m.content for m in default] == [m.content for m in cold]
    assert all(m.response_metadata["reused_moved"] == 0 for m in default)
    assert all(m.response_metadata["reused_exact"] > 0 for m in default[1:])        # the system prompt at least


def _document_reuse(metadata, retrieved, document_tokens, prefix_tokens) -> float:
    """Share of already-seen document tokens whose KV was reused, over the questions after the first."""
    seen, reusable, reused = set(retrieved[0]), 0, 0
    for meta, docs, prefix in zip(metadata[1:], retrieved[1:], prefix_tokens[1:]):
        reusable += sum(document_tokens[d] for d in docs if d in seen)
        reused += max(0, meta["reused_tokens"] - prefix)
        seen.update(docs)
    return reused / reusable


def _block_prefix_tokens(engine, retriever):
    """Tokens before the first document block, per question (system prompt and template glue)."""
    counts = []
    for question in QUESTIONS:
        messages = to_engine_messages(retrieval_messages(retriever, system=SYSTEM).invoke(question).to_messages(),
                                      native_tools=False)
        prompt = engine.encode_messages(messages)
        first_doc = prompt.chunk_kinds.index("document")
        counts.append(prompt.chunk_ends[first_doc - 1])
    return counts


def test_block_chain_answers_match_the_cache_off_chain_where_reuse_is_exact(block_chain_runs):
    warm, cold = block_chain_runs["moved"], block_chain_runs["cold"]
    exact = [i for i, m in enumerate(warm) if m.response_metadata["reused_moved"] == 0]
    assert exact, "no request with exact reuse only"
    assert [warm[i].content for i in exact] == [cold[i].content for i in exact]
    assert all(m.response_metadata["reused_tokens"] > 0 for m in warm[1:])     # system prompt at least
    assert all(m.response_metadata["reused_tokens"] == 0 for m in cold)


def test_block_chain_reuses_documents_that_come_back_in_the_same_order(smol, retriever):
    engine = _engine(smol, 256 * 2**20)
    chain = retrieval_messages(retriever, system=SYSTEM) | ChatKVBoost(engine=engine, max_tokens=4)
    question = QUESTIONS[0]
    chain.invoke(question)
    again = chain.invoke(question + " Answer briefly.")        # same documents, same order, new question
    docs = [d.page_content for d in retriever.invoke(question)]
    assert docs == [d.page_content for d in retriever.invoke(question + " Answer briefly.")]
    document_tokens = sum(len(engine.tokenizer(d, add_special_tokens=False)["input_ids"]) for d in docs)
    prefix = _block_prefix_tokens(engine, retriever)[0]
    assert again.response_metadata["reused_exact"] - prefix >= 0.8 * document_tokens


def test_block_chain_reuses_80_percent_of_document_tokens_with_moved_reuse(smol, retriever, retrieved,
                                                                             block_chain_runs):
    warm = block_chain_runs["moved"]
    engine = _engine(smol, 0)
    document_tokens = {d: len(engine.tokenizer(d, add_special_tokens=False)["input_ids"]) for d in CORPUS}
    share = _document_reuse([m.response_metadata for m in warm], retrieved, document_tokens,
                            _block_prefix_tokens(engine, retriever))
    assert share >= 0.8, f"reused {share:.0%} of document tokens"


def _unmodified_chain(smol, retriever, cache_bytes, **options):
    """(b): LangChain's own create_retrieval_chain + create_stuff_documents_chain, untouched."""
    classic = pytest.importorskip("langchain_classic.chains")
    from langchain_classic.chains.combine_documents import create_stuff_documents_chain
    from langchain_core.prompts import ChatPromptTemplate

    engine = _engine(smol, cache_bytes, **options)
    prompt = ChatPromptTemplate.from_messages([("system", SYSTEM + "\n\n{context}"), ("human", "{input}")])
    chain = classic.create_retrieval_chain(retriever, create_stuff_documents_chain(
        ChatKVBoost(engine=engine, max_tokens=8), prompt))
    recorder = MetadataRecorder()
    answers = [chain.invoke({"input": q}, config={"callbacks": [recorder]}) for q in QUESTIONS]
    return engine, answers, recorder.metadata


@pytest.fixture(scope="module")
def unmodified_chain_runs(smol, retriever):
    return _unmodified_chain(smol, retriever, 256 * 2**20, moved_reuse="blend")


def test_unmodified_chain_with_default_settings_answers_exactly_like_the_cache_off_chain(smol, retriever):
    _, default, _ = _unmodified_chain(smol, retriever, 256 * 2**20)
    _, cold, _ = _unmodified_chain(smol, retriever, 0)
    assert [a["answer"] for a in default] == [a["answer"] for a in cold]


def test_unmodified_retrieval_chain_runs_and_reports_metadata(unmodified_chain_runs, retrieved):
    engine, answers, metadata = unmodified_chain_runs
    assert all(isinstance(a["answer"], str) and a["answer"] for a in answers)
    assert len(metadata) == len(QUESTIONS)
    for question, docs, meta in zip(QUESTIONS, retrieved, metadata):
        # the chain's prompt: the documents joined into the system message, then the question
        expected = engine.count_tokens([{"role": "system", "content": SYSTEM + "\n\n" + "\n\n".join(docs)},
                                        {"role": "user", "content": question}])
        assert meta["prompt_tokens"] == expected
        assert meta["reused_tokens"] == meta["reused_exact"] + meta["reused_moved"] <= meta["prompt_tokens"]


def test_unmodified_retrieval_chain_reuses_90_percent_of_document_tokens_with_moved_reuse(unmodified_chain_runs,
                                                                                            retrieved):
    engine, _, metadata = unmodified_chain_runs
    tokenizer = engine.tokenizer
    document_tokens = {d: len(tokenizer(d, add_special_tokens=False)["input_ids"]) for d in CORPUS}
    system_tokens = engine.count_tokens([{"role": "system", "content": SYSTEM + "\n\n"}])
    share = _document_reuse(metadata, retrieved, document_tokens, [system_tokens] * len(QUESTIONS))
    assert share >= 0.9, f"reused {share:.0%} of document tokens"


def test_cache_aware_order_and_warming_reuse_documents_exactly(smol, retriever):
    from kvboost_integrations.langchain import warm_documents
    engine = _engine(smol, 256 * 2**20)
    llm = ChatKVBoost(engine=engine, max_tokens=4, document_order="cache")
    warm_documents(llm, [CORPUS[0], CORPUS[1]], system=SYSTEM)
    chain = retrieval_messages(retriever, system=SYSTEM) | llm
    replies = [chain.invoke(q) for q in QUESTIONS]
    placed = [r.response_metadata["documents_from_cache"] for r in replies]
    assert all(r.response_metadata["reused_moved"] == 0 for r in replies)
    assert sum(placed) >= len(QUESTIONS) and all(p >= 1 for p in placed[1:])
