"""Acceptance: questions whose retrieved nodes overlap in another order reuse the nodes' KV.

Each test starts on a fresh cache, asks QUESTIONS in order and measures, over the questions
after the first, the share of retrieved-node tokens whose KV came from the cache.
"""
from __future__ import annotations

import pytest

pytest.importorskip("llama_index.core")

from llama_index.core import Document, VectorStoreIndex  # noqa: E402
from llama_index.core.node_parser import SentenceSplitter  # noqa: E402

from kvboost_integrations.llama_index import KVBoost, ModelTokenizer, as_query_engine  # noqa: E402
from llama_index_corpus import CORPUS, QUESTIONS, HashEmbedding, LLMRecorder  # noqa: E402

TOP_K = 3


@pytest.fixture(scope="module")
def index(smol):
    splitter = SentenceSplitter(chunk_size=512, chunk_overlap=0, tokenizer=ModelTokenizer(smol[1]))
    documents = [Document(text=text, id_=name) for name, text in CORPUS.items()]
    return VectorStoreIndex.from_documents(documents, embed_model=HashEmbedding(), transformations=[splitter])


def synthesizer_node_reuse(query_engine) -> tuple[float, list]:
    """Node-token reuse over questions 2..n, from each response's metadata["kvboost"]."""
    telemetry = [query_engine.query(q).metadata["kvboost"] for q in QUESTIONS]
    later = telemetry[1:]
    share = sum(t["document_tokens_reused"] for t in later) / sum(t["document_tokens"] for t in later)
    return share, [(t["document_tokens_reused"], t["document_tokens"]) for t in telemetry]


def test_source_order_reuses_overlapping_nodes_exactly(index, engine):
    llm = KVBoost(engine=engine, max_new_tokens=2)
    share, per_question = synthesizer_node_reuse(as_query_engine(index, llm, similarity_top_k=TOP_K,
                                                                 node_order="source"))
    print(f"node-aligned, source order: node tokens reused {share:.1%} {per_question}")
    assert share >= 0.8, per_question
    assert per_question[1][0] == per_question[1][1]          # same nodes, other ranking: all reused


def test_by_default_answers_equal_the_cache_off_answers(index, engine, cold_engine):
    """Exact reuse only by default: the node-aligned and the stock query engines answer as without cache."""
    for make in (lambda llm: as_query_engine(index, llm, similarity_top_k=TOP_K),
                 lambda llm: index.as_query_engine(llm=llm, similarity_top_k=TOP_K)):
        warm, cold = make(KVBoost(engine=engine, max_new_tokens=8)), make(KVBoost(engine=cold_engine, max_new_tokens=8))
        assert [str(warm.query(q)) for q in QUESTIONS] == [str(cold.query(q)) for q in QUESTIONS]
    assert engine.stats()["moved_hits"] == 0 and engine.stats()["hit_tokens"] > 0


def test_node_aligned_synthesizer_reuses_80_percent_of_node_tokens(index, moved_engine):
    engine = moved_engine
    llm = KVBoost(engine=engine, max_new_tokens=2)
    share, per_question = synthesizer_node_reuse(as_query_engine(index, llm, similarity_top_k=TOP_K))
    print(f"node-aligned, retrieved order: node tokens reused {share:.1%} {per_question}")
    assert share >= 0.8, per_question


def test_stock_synthesizer_reuses_90_percent_of_node_tokens_with_moved_reuse(index, moved_engine):
    engine = moved_engine
    llm = KVBoost(engine=engine, max_new_tokens=2)
    query_engine = index.as_query_engine(llm=llm, similarity_top_k=TOP_K)
    per_question = []
    with LLMRecorder() as recorder:
        for question in QUESTIONS:
            response = query_engine.query(question)
            call = recorder.calls[-1]
            per_question.append(_stock_node_reuse(engine, call, [n.node.get_content() for n in response.source_nodes]))
    later = per_question[1:]
    share = sum(r for r, _ in later) / sum(n for _, n in later)
    print(f"stock synthesizer: node tokens reused {share:.1%} {per_question}")
    assert share >= 0.9, per_question


def _stock_node_reuse(engine, call, node_texts: list[str]) -> tuple[int, int]:
    """(reused node tokens, node tokens) of one stock prompt, where all nodes sit in one string.

    Reused tokens beyond the prompt's head (system prompt and the text before the first node,
    counted with the generation glue, so a slight over-count) are taken as node tokens.
    """
    system, user = call["messages"][0], call["messages"][-1]
    content = user.content
    first = min(content.index(text.strip()) for text in node_texts)
    head = engine.count_tokens([{"role": "system", "content": system.content},
                                {"role": "user", "content": content[:first]}])
    node_tokens = sum(len(engine.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in node_texts)
    reused = max(0, call["raw"]["kvboost"]["reused_tokens"] - head)
    return min(reused, node_tokens), node_tokens


def test_cache_order_and_warmed_nodes_are_reused_exactly(smol, engine):
    """Nodes warmed at ingestion (WarmNodes) and cache-aware node order: exact reuse only."""
    from kvboost_integrations.llama_index import KVBoostSynthesizer, WarmNodes
    llm = KVBoost(engine=engine, max_new_tokens=2)
    synthesizer = KVBoostSynthesizer(llm, "compact", node_order="cache")
    splitter = SentenceSplitter(chunk_size=512, chunk_overlap=0, tokenizer=ModelTokenizer(smol[1]))
    documents = [Document(text=text, id_=name) for name, text in CORPUS.items()]
    warmed = VectorStoreIndex.from_documents(documents, embed_model=HashEmbedding(),
                                             transformations=[splitter, WarmNodes(synthesizer=synthesizer)])
    query_engine = warmed.as_query_engine(llm=llm, response_synthesizer=synthesizer, similarity_top_k=TOP_K)
    telemetry = [query_engine.query(q).metadata["kvboost"] for q in QUESTIONS]
    assert all(t["reused_moved"] == 0 for t in telemetry)
    assert all(t["documents_from_cache"] >= 1 for t in telemetry)       # a warmed node goes first, every time
    assert telemetry[0]["document_tokens_reused"] > 0                    # even for the very first question


def test_warmed_nodes_with_metadata_are_reused(smol, engine):
    """Loaders add metadata (file_name, file_path, ...) that synthesis sends before a node's text; warm()
    cached the text alone, so no warmed node was ever found (documents_from_cache 0, reuse 0)."""
    from kvboost_integrations.llama_index import KVBoostSynthesizer, WarmNodes
    llm = KVBoost(engine=engine, max_new_tokens=2)
    synthesizer = KVBoostSynthesizer(llm, "compact", node_order="cache")
    splitter = SentenceSplitter(chunk_size=512, chunk_overlap=0, tokenizer=ModelTokenizer(smol[1]))
    documents = [Document(text=text, id_=name, metadata={"file_name": f"{name}.txt", "author": "Ana"})
                 for name, text in list(CORPUS.items())[:3]]
    warmed = VectorStoreIndex.from_documents(documents, embed_model=HashEmbedding(),
                                             transformations=[splitter, WarmNodes(synthesizer=synthesizer)])
    query_engine = warmed.as_query_engine(llm=llm, response_synthesizer=synthesizer, similarity_top_k=1)
    telemetry = query_engine.query(QUESTIONS[0]).metadata["kvboost"]
    assert telemetry["documents_from_cache"] == 1 and telemetry["document_reuse"] == 1.0, telemetry
