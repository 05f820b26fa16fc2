"""ChatKVBoost, KVBoostLLM and LlamaIndex KVBoost with `endpoint=`: the same classes over an
OpenAI-compatible server (here the in-process fake; tests/test_remote_server.py uses a real one)."""
from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("openai")
pytest.importorskip("langchain_core")
pytest.importorskip("llama_index.core")

from fake_openai_server import FakeServer  # noqa: E402
from langchain_core.documents import Document  # noqa: E402
from langchain_core.messages import HumanMessage, SystemMessage  # noqa: E402
from langchain_core.runnables import RunnableLambda  # noqa: E402
from llama_index.core import Document as LlamaDocument  # noqa: E402
from llama_index.core import VectorStoreIndex  # noqa: E402
from llama_index.core.base.llms.types import ChatMessage  # noqa: E402

from kvboost_engine import InputError  # noqa: E402
from kvboost_integrations.langchain import ChatKVBoost, KVBoostLLM, retrieval_messages  # noqa: E402
from kvboost_integrations.llama_index import KVBoost, as_query_engine  # noqa: E402
from kvboost_integrations.remote import RemoteEngine  # noqa: E402
from llama_index_corpus import CORPUS, QUESTIONS, HashEmbedding  # noqa: E402

DOCS = ["The kettle warranty lasts two years.", "The toaster warranty lasts one year.",
        "Shipping is free above fifty euros."]


@pytest.fixture
def server():
    with FakeServer() as fake:
        yield fake


def test_chat_model_invoke_stream_async_stop_and_metadata(server):
    llm = ChatKVBoost(endpoint=server.url, max_tokens=16)
    message = llm.invoke([SystemMessage("Be brief."), HumanMessage("Hi")])
    assert message.content == server.reply
    assert message.usage_metadata["input_tokens"] > 5 and message.usage_metadata["output_tokens"] == 11
    meta = message.response_metadata
    assert meta["finish_reason"] == "stop" and meta["replica"] == server.url and meta["model_name"] == "fake-model"
    again = llm.invoke([SystemMessage("Be brief."), HumanMessage("Hi there")])
    assert again.usage_metadata["input_token_details"]["cache_read"] == again.response_metadata["reused_tokens"] > 5
    chunks = list(llm.stream("Hi"))
    assert "".join(c.content for c in chunks) == server.reply and len(chunks) > 5
    assert llm.invoke("Hi", stop=["42"]).content == "The answer is "

    async def run():
        return await llm.ainvoke("Hi"), [c async for c in llm.astream("Hi")]

    message, achunks = asyncio.run(run())
    assert message.content == server.reply == "".join(c.content for c in achunks)


def test_chat_model_tools_through_the_server(server):
    llm = ChatKVBoost(endpoint=server.url)

    def weather(city: str) -> str:
        """The weather in a city."""
        return "sunny"

    message = llm.bind_tools([weather], tool_choice="any").invoke("Weather in Paris?")
    assert message.tool_calls == [{"name": "weather", "args": {"city": "Paris"}, "id": "call_fake",
                                   "type": "tool_call"}]
    assert server.requests[-1]["tool_choice"] == "required"
    assert server.requests[-1]["tools"][0]["function"]["name"] == "weather"


def test_lcel_rag_chain_sends_documents_in_cache_order(server):
    orders = [DOCS, [DOCS[2], DOCS[0], DOCS[1]]]
    retriever = RunnableLambda(lambda q: [Document(page_content=d) for d in orders[len(server.requests) % 2]])
    chain = retrieval_messages(retriever, system="Answer from the documents.") | ChatKVBoost(endpoint=server.url)
    first = chain.invoke("How long is the kettle warranty?")
    second = chain.invoke("How long is the toaster warranty?")
    assert first.content == second.content == server.reply
    sent = [r["messages"][-1]["content"] for r in server.requests if r["path"] == "/v1/chat/completions"]
    assert [s.index(DOCS[0]) < s.index(DOCS[2]) for s in sent] == [True, True]    # the first order, both times
    assert second.response_metadata["reused_tokens"] > first.response_metadata["prompt_tokens"] * 0.5


def test_text_llm_completes_plain_prompts(server):
    llm = KVBoostLLM(endpoint=server.url, max_tokens=3)
    assert llm.invoke("Once upon a time") == "The answer"
    result = llm.generate(["Once upon a time"])
    info = result.generations[0][0].generation_info
    assert info["finish_reason"] == "length" and info["usage_metadata"]["output_tokens"] == 3
    assert asyncio.run(llm.ainvoke("Once")) == "The answer"


def test_local_options_with_an_endpoint_are_an_error(server):
    with pytest.raises(ValueError, match="cache_bytes"):
        ChatKVBoost(endpoint=server.url, cache_bytes=1)
    with pytest.raises(InputError, match="dtype"):
        KVBoost(endpoint=server.url, dtype="float32")
    with pytest.raises(InputError, match="did you mean 'routing'"):
        ChatKVBoost(endpoint=server.url, engine_kwargs={"routin": "cache"}).invoke("Hi")


def test_a_shared_remote_engine_and_engine_kwargs(server):
    engine = RemoteEngine(server.url, document_order="relevance")
    assert ChatKVBoost(engine=engine).invoke("Hi").content == server.reply
    assert KVBoost(engine=engine).complete("Hi").text == server.reply
    llm = ChatKVBoost(endpoint=[server.url], engine_kwargs={"routing": "round_robin"})
    llm.invoke("Hi")
    assert llm.get_engine().router.policy == "round_robin"


def test_document_order_of_the_class_reaches_the_layout(server):
    assert ChatKVBoost(endpoint=server.url).get_engine().layout.options.document_order == "cache"
    llm = ChatKVBoost(endpoint=server.url, document_order="relevance")
    assert llm.get_engine().layout.options.document_order == "relevance"
    llm = KVBoost(endpoint=server.url, document_order="relevance", engine_kwargs={"document_order": "cache"})
    assert llm.engine.layout.options.document_order == "cache"             # engine_kwargs win


def test_api_key_without_endpoint_is_accepted_and_loads_nothing():
    llm = ChatKVBoost(api_key="test", max_tokens=4)          # LangChain's standard unit suite passes one
    assert llm._engine is None and llm.endpoint is None


def test_llama_index_cache_order_reports_documents_placed(server):
    llm = KVBoost(endpoint=server.url, max_new_tokens=32)
    documents = [LlamaDocument(text=text, id_=name) for name, text in CORPUS.items()]
    index = VectorStoreIndex.from_documents(documents, embed_model=HashEmbedding())
    engine = as_query_engine(index, llm, similarity_top_k=3, node_order="cache")
    first = engine.query(QUESTIONS[0])
    again = engine.query(QUESTIONS[0])
    assert str(again) == server.reply
    assert (first.metadata["kvboost"]["documents_from_cache"], again.metadata["kvboost"]["documents_from_cache"]) == (0, 3)


def test_llama_index_llm_chat_stream_async(server):
    llm = KVBoost(endpoint=server.url, max_new_tokens=16)
    response = llm.chat([ChatMessage(role="user", content="Hi")])
    assert response.message.content == server.reply
    assert response.raw["usage"]["prompt_tokens"] > 5 and response.raw["kvboost"]["replica"] == server.url
    assert "".join(r.delta for r in llm.stream_chat([ChatMessage(role="user", content="Hi")])) == server.reply
    assert asyncio.run(llm.acomplete("Hi")).text == server.reply
    assert llm.metadata.context_window == 4096 and llm.metadata.model_name == "fake-model"


def test_llama_index_query_engine_through_the_remote_backend(server):
    llm = KVBoost(endpoint=server.url, max_new_tokens=32)
    documents = [LlamaDocument(text=text, id_=name) for name, text in CORPUS.items()]
    index = VectorStoreIndex.from_documents(documents, embed_model=HashEmbedding())
    engine = as_query_engine(index, llm, similarity_top_k=3)
    response = engine.query(QUESTIONS[0])
    assert str(response) == server.reply
    telemetry = response.metadata["kvboost"]
    assert telemetry["llm_calls"] == 1 and telemetry["document_tokens"] > 50
    again = asyncio.run(engine.aquery(QUESTIONS[0]))
    assert again.metadata["kvboost"]["document_reuse"] > 0.9


def test_llama_index_tools_and_structured_output_go_to_the_server(server):
    from llama_index.core.prompts import PromptTemplate
    from llama_index.core.tools import FunctionTool
    from pydantic import BaseModel

    def weather(city: str) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    class City(BaseModel):
        name: str
        population: int

    llm = KVBoost(endpoint=server.url)
    tool = FunctionTool.from_defaults(fn=weather)
    response = llm.chat_with_tools([tool], user_msg="Weather in Paris?", tool_required=True)
    sent = server.requests[-1]
    assert sent["tools"][0]["function"]["name"] == "weather" and sent["tool_choice"] == "required"
    calls = llm.get_tool_calls_from_response(response)
    assert [(c.tool_name, c.tool_kwargs) for c in calls] == [("weather", {"city": "Paris"})]
    assert str(llm.predict_and_call([tool], "Weather in Paris?", tool_required=True)) == "sunny in Paris"
    city = llm.structured_predict(City, PromptTemplate("Which city is {q}?"), q="the capital of France")
    assert city == City(name="Paris", population=42)
    assert server.requests[-1]["response_format"]["json_schema"]["schema"]["required"] == ["name", "population"]
    assert asyncio.run(llm.astructured_predict(City, PromptTemplate("Which city?"))) == city
