"""The framework classes over a real OpenAI-compatible server (marked `remote`).

The server: KVBOOST_REMOTE_URL if set (any vLLM or llama-server serving the default model),
else llama-server started here on 127.0.0.1 from KVBOOST_LLAMA_SERVER / KVBOOST_LLAMA_GGUF (or
what `.ci/remote.sh` built). Without either, these tests are skipped. The model is the Q4_1 GGUF,
not kvboost's fp32 weights: answers are checked for substance, not compared token by token.
"""
from __future__ import annotations

import asyncio
import os

import pytest

pytest.importorskip("openai")
pytest.importorskip("langchain_core")
pytest.importorskip("llama_index.core")

from langchain_core.documents import Document  # noqa: E402
from langchain_core.messages import HumanMessage, SystemMessage  # noqa: E402
from langchain_core.runnables import RunnableLambda  # noqa: E402
from llama_index.core import Document as LlamaDocument  # noqa: E402
from llama_index.core import VectorStoreIndex  # noqa: E402

from kvboost_integrations.langchain import ChatKVBoost, KVBoostLLM, retrieval_messages  # noqa: E402
from kvboost_integrations.llama_index import KVBoost, as_query_engine  # noqa: E402
from kvboost_integrations.remote import RemoteEngine  # noqa: E402
from kvboost_tools.servers import free_port, llama_binary, llama_gguf, start_llama_server  # noqa: E402
from llama_index_corpus import CORPUS, QUESTIONS, HashEmbedding  # noqa: E402

pytestmark = pytest.mark.remote

SYSTEM = "You are a helpful assistant. Answer in one short sentence."
DOCS = ["The Orion kettle has a two-year warranty on its heating element.",
        "The Vega blender has a three-year warranty on its motor.",
        "Orders above fifty euros ship for free."]


@pytest.fixture(scope="module")
def endpoint():
    url = os.environ.get("KVBOOST_REMOTE_URL")
    if url:
        yield url
        return
    if not (llama_binary().is_file() and llama_gguf().is_file()):
        pytest.skip("no server: set KVBOOST_REMOTE_URL, or build llama-server with `bash .ci/remote.sh`")
    with start_llama_server() as server:
        yield server.url


def test_chat_invoke_stream_async_and_stop(endpoint):
    llm = ChatKVBoost(endpoint=endpoint, max_tokens=24)
    messages = [SystemMessage(SYSTEM), HumanMessage("What colour is the sky on a clear day?")]
    message = llm.invoke(messages)
    assert message.content.strip() and message.usage_metadata["output_tokens"] > 0
    assert message.response_metadata["finish_reason"] in ("stop", "length")
    streamed = list(llm.stream(messages))
    assert len(streamed) > 2 and "".join(c.content for c in streamed).strip()
    again = streamed[-1].usage_metadata["input_token_details"]["cache_read"]
    assert again >= message.usage_metadata["input_tokens"] - 8       # the same prompt: served from the cache
    counted = llm.invoke([SystemMessage(SYSTEM), HumanMessage("Count from 1 to 9, separated by commas.")],
                         stop=["5"])
    assert "5" not in counted.content and counted.response_metadata["finish_reason"] == "stop"

    async def run():
        return await llm.ainvoke(messages), [c.content async for c in llm.astream(messages)]

    amessage, achunks = asyncio.run(run())
    assert amessage.content.strip() and "".join(achunks).strip()


def test_text_completion(endpoint):
    text = KVBoostLLM(endpoint=endpoint, max_tokens=8).invoke("The capital of France is")
    assert text.strip()


def test_lcel_rag_chain_and_server_cache_hits(endpoint):
    orders = iter([DOCS, [DOCS[1], DOCS[2], DOCS[0]]])
    retriever = RunnableLambda(lambda _: [Document(page_content=d) for d in next(orders)])
    llm = ChatKVBoost(endpoint=endpoint, max_tokens=24)
    chain = retrieval_messages(retriever, system="Answer from the documents in one sentence.") | llm
    first = chain.invoke("How long is the kettle warranty?")
    second = chain.invoke("How long is the blender warranty?")
    assert first.content.strip() and second.content.strip()
    # the second question retrieved the same documents in another order: sent in the cached order
    assert second.response_metadata["reused_tokens"] > 40
    report = llm.get_engine().cache_report()
    assert report["total"]["requests"] == 2 and report["total"]["cached_tokens"] > 40
    server = report["replicas"][llm.get_engine().router.names[0]]["server"]
    assert server is None or server["hits"] >= second.response_metadata["reused_tokens"]


def test_llama_index_query_engine(endpoint):
    llm = KVBoost(endpoint=endpoint, max_new_tokens=24)
    index = VectorStoreIndex.from_documents([LlamaDocument(text=t, id_=n) for n, t in CORPUS.items()],
                                            embed_model=HashEmbedding())
    engine = as_query_engine(index, llm, similarity_top_k=2)
    response = engine.query(QUESTIONS[0])
    assert str(response).strip() and response.metadata["kvboost"]["llm_calls"] >= 1
    again = asyncio.run(engine.aquery(QUESTIONS[0]))
    assert str(again).strip() and again.metadata["kvboost"]["reused_tokens"] > 0


def test_a_replica_that_is_down_fails_over(endpoint):
    dead = f"http://127.0.0.1:{free_port()}/v1"
    engine = RemoteEngine([dead, endpoint], routing="round_robin", cooldown_s=0)   # the dead one stays in turn
    llm = ChatKVBoost(engine=engine, max_tokens=8)
    messages = [llm.invoke("Say hello."), llm.invoke("Say hello again.")]
    assert all(m.content.strip() and m.response_metadata["replica"] == engine.router.names[1] for m in messages)
    assert [dead] in [m.response_metadata["failovers"] for m in messages]
    assert engine.cache_report()["replicas"][dead]["failures"] >= 1
