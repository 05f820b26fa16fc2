"""Query and chat engines over a VectorStoreIndex with the KVBoost LLM (real default model,
offline hashing embedding): our node-aligned synthesizer and the stock one."""
from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("llama_index.core")

from llama_index.core import Document, VectorStoreIndex  # noqa: E402
from llama_index.core.base.response.schema import AsyncStreamingResponse, StreamingResponse  # noqa: E402
from llama_index.core.node_parser import SentenceSplitter  # noqa: E402

from kvboost_engine import Engine  # noqa: E402
from kvboost_integrations.llama_index import (DOCUMENT_BLOCKS, KVBoost, KVBoostSynthesizer, ReuseRecorder,  # noqa: E402
                                              as_query_engine)
from llama_index_corpus import CORPUS, QUESTIONS, HashEmbedding, LLMRecorder  # noqa: E402

TOP_K = 3


@pytest.fixture(scope="module")
def llm(smol):
    """One engine for the module: later tests run on a warm cache, as a served app would."""
    return KVBoost(engine=Engine(*smol, cache_bytes=256 * 2**20), max_new_tokens=4)


@pytest.fixture(scope="module")
def index(llm):
    documents = [Document(text=text, id_=name) for name, text in CORPUS.items()]
    splitter = SentenceSplitter(chunk_size=512, chunk_overlap=0, tokenizer=llm.tokenizer)
    return VectorStoreIndex.from_documents(documents, embed_model=HashEmbedding(), transformations=[splitter])


def ref_ids(response) -> list[str]:
    return [n.node.ref_doc_id for n in response.source_nodes]


def test_node_aligned_query_engine_sync_async_and_streaming(llm, index):
    engine = as_query_engine(index, llm, similarity_top_k=TOP_K)
    response = engine.query(QUESTIONS[0])
    assert str(response).strip() and ref_ids(response) == ["apples", "honey", "copper"]
    first = response.metadata["kvboost"]
    assert first["llm_calls"] == 1 and first["document_tokens"] > 100

    again = asyncio.run(engine.aquery(QUESTIONS[0]))
    assert str(again) == str(response)
    assert again.metadata["kvboost"]["document_reuse"] == 1.0       # same nodes, same place: exact

    streaming = as_query_engine(index, llm, similarity_top_k=TOP_K, streaming=True)
    streamed = streaming.query(QUESTIONS[0])
    assert isinstance(streamed, StreamingResponse)
    assert "".join(streamed.response_gen) == str(response)
    assert streamed.metadata["kvboost"]["llm_calls"] == 1             # filled when the stream ended

    async def astream():
        result = await streaming.aquery(QUESTIONS[0])
        assert isinstance(result, AsyncStreamingResponse)
        return "".join([t async for t in result.async_response_gen()]), result
    text, result = asyncio.run(astream())
    assert text == str(response) and result.metadata["kvboost"]["document_reuse"] == 1.0


def test_stock_query_engine_works_unmodified(llm, index):
    engine = index.as_query_engine(llm=llm, similarity_top_k=TOP_K)
    with ReuseRecorder() as recorder:
        response = engine.query(QUESTIONS[1])
        again = asyncio.run(engine.aquery(QUESTIONS[1]))
        streamed = index.as_query_engine(llm=llm, similarity_top_k=TOP_K, streaming=True).query(QUESTIONS[1])
        streamed_text = "".join(streamed.response_gen)
    assert str(response).strip() and ref_ids(response) == ["copper", "apples", "honey"]
    assert str(again) == str(response) == streamed_text
    assert len(recorder.records) == 3                                  # sync, async and streamed calls
    repeat = recorder.records[1]
    # Exact reuse only (the default): the repeat reuses its whole prompt, all of it exact.
    assert repeat["reused_exact"] == repeat["prompt_tokens"] - 1 and repeat["reused_moved"] == 0


def test_compact_over_a_small_window_splits_between_whole_nodes(smol, index, llm):
    small = KVBoost(engine=llm.engine, max_new_tokens=4, context_window=300)
    synthesizer = KVBoostSynthesizer(small, "compact")
    with LLMRecorder() as recorder:
        response = index.as_query_engine(llm=small, response_synthesizer=synthesizer,
                                         similarity_top_k=TOP_K).query(QUESTIONS[0])
    assert response.metadata["kvboost"]["llm_calls"] == len(recorder.calls) >= 2
    assert "Original Answer" in recorder.calls[-1]["messages"][-1].blocks[-1].text   # refined
    node_texts = {n.node.get_content() for n in response.source_nodes}
    seen = []
    for call in recorder.calls:
        user = call["messages"][-1]
        seen += [user.blocks[i].text for i in user.additional_kwargs[DOCUMENT_BLOCKS]]
    assert sorted(seen) == sorted(node_texts)                         # every node whole, exactly once


@pytest.mark.parametrize("mode, calls", [("refine", 3), ("tree_summarize", 1)])
def test_refine_and_tree_summarize_modes(llm, index, mode, calls):
    engine = as_query_engine(index, llm, response_mode=mode, similarity_top_k=TOP_K)
    response = engine.query(QUESTIONS[0])
    assert str(response).strip()
    telemetry = response.metadata["kvboost"]
    assert telemetry["llm_calls"] == calls and len(telemetry["calls"]) == calls


def test_tree_summarize_combines_group_answers(llm, index):
    small = KVBoost(engine=llm.engine, max_new_tokens=4, context_window=300)
    engine = as_query_engine(index, small, response_mode="tree_summarize", similarity_top_k=TOP_K)
    response = engine.query(QUESTIONS[0])
    assert response.metadata["kvboost"]["llm_calls"] >= 3               # groups, then their answers


def test_default_chat_engine_over_two_turns(llm, index):
    chat = index.as_chat_engine(llm=llm, similarity_top_k=2)
    first = chat.chat("Where do the apples grow?")
    assert str(first).strip() and first.source_nodes
    second = chat.stream_chat("And how much honey does a hive give?")
    text = "".join(second.response_gen)
    assert text.strip()
    assert [m.role.value for m in chat.chat_history] == ["user", "assistant", "user", "assistant"]


def test_node_aligned_query_engine_on_a_model_without_a_chat_template(smol, index):
    """A model without a chat template (Gemma 3 270M base) answers through messages_to_prompt, as the
    stock query engine showed; the node-aligned one counted its budget with the chat template and
    failed: "this model's tokenizer has no chat template"."""
    import copy
    model, tokenizer = smol
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    llm = KVBoost(engine=Engine(model, plain, cache_bytes=64 * 2**20), max_new_tokens=4,
                  messages_to_prompt=lambda ms: "\n".join(f"{m.role.value}: {m.content}" for m in ms) + "\nassistant:")
    messages = llm._extend_messages([])
    assert llm.count_prompt_tokens(messages) == llm.engine.count_tokens(llm.messages_to_prompt(messages))
    response = as_query_engine(index, llm, similarity_top_k=TOP_K).query(QUESTIONS[0])
    assert len(response.metadata["kvboost"]["calls"]) >= 1 and str(response)
    assert KVBoostSynthesizer(llm, "compact").warm(["The mine closed in 1962."]) > 0     # as chat() sends it
    llm.engine.close()
