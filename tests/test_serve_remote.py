"""Our remote classes on our own server: they know it (/v1/models `owned_by: "kvboost"`), send
document parts as they are (other servers get them as text), count tokens with its /tokenize, and
reply as the same classes on the embedded engine do."""
from __future__ import annotations

import httpx
import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")

from langchain_core.messages import HumanMessage, SystemMessage  # noqa: E402

from kvboost_engine import Engine  # noqa: E402
from kvboost_engine.serve import Server, create_app  # noqa: E402
from kvboost_integrations.langchain import ChatKVBoost  # noqa: E402
from kvboost_integrations.langchain.messages import document_block  # noqa: E402
from kvboost_integrations.remote import RemoteEngine  # noqa: E402
from kvboost_tools.fake_openai import FakeServer  # noqa: E402

KEY = "test-key"
DOCS = ["Marie Curie was a physicist and chemist who worked in Paris on radioactivity.",
        "The Eiffel Tower was built for the 1889 World's Fair and is 330 metres tall."]
QUESTION = "How tall is the Eiffel Tower?"


def rag_messages() -> list:
    return [SystemMessage("Answer from the documents in one short sentence."),
            HumanMessage([document_block(DOCS[0]), document_block(DOCS[1]), {"type": "text", "text": QUESTION}])]


@pytest.fixture(scope="module")
def served(smol):
    engine = Engine(*smol, cache_bytes=256 * 2**20)
    received: list = []
    stream_chat = engine.stream_chat

    def spy(messages, **kwargs):            # what reaches the engine through HTTP
        received.append(messages)
        return stream_chat(messages, **kwargs)
    engine.stream_chat = spy
    with Server(create_app(engine, model_name="smol", api_key=KEY)) as server:
        yield engine, server, received
    engine.close()


def test_chat_kvboost_sends_document_parts_and_replies_as_local(served):
    engine, server, received = served
    remote = ChatKVBoost(endpoint=server.url, api_key=KEY, max_tokens=12)
    local = ChatKVBoost(engine=engine, max_tokens=12, document_order="relevance")
    assert remote.get_engine().server_info().kind == "kvboost"
    expected = local.invoke(rag_messages())
    received.clear()
    reply = remote.invoke(rag_messages())
    assert reply.content == expected.content
    user = received[-1][-1]["content"]
    assert [part["type"] for part in user] == ["document", "document", "text"]
    assert [part["text"] for part in user[:2]] == DOCS
    usage = reply.usage_metadata
    assert usage["input_tokens"] == expected.usage_metadata["input_tokens"]
    assert usage["input_token_details"]["cache_read"] > 0          # the local call cached the same prompt
    assert remote.get_num_tokens_from_messages(rag_messages()) == usage["input_tokens"]
    remote.get_engine().close()


def test_tokenize_in_vllm_shape(served):
    engine, server, _ = served
    headers = {"Authorization": f"Bearer {KEY}"}
    root = server.url[:-3]
    text = httpx.post(root + "/tokenize", json={"prompt": "Hello there", "add_special_tokens": False},
                      headers=headers, timeout=30).json()
    assert text["tokens"] == engine.tokenizer("Hello there", add_special_tokens=False)["input_ids"]
    messages = [{"role": "user", "content": [{"type": "document", "text": DOCS[0]}, {"type": "text", "text": "Q?"}]}]
    chat = httpx.post(root + "/tokenize", json={"messages": messages}, headers=headers, timeout=30).json()
    assert chat["count"] == len(engine.encode_messages(messages)) and chat["max_model_len"] == engine.context_window
    assert httpx.post(root + "/tokenize", json={"prompt": "x"}, timeout=30).status_code == 401
    bad = httpx.post(root + "/tokenize", json={"prompt": "x", "messages": []}, headers=headers, timeout=30)
    assert bad.status_code == 400
    plain = httpx.post(root + "/tokenize", json={"messages": messages, "chat_template_kwargs": {"add_generation_prompt": False}},
                       headers=headers, timeout=30).json()                # as the chat route reads it (was a 500)
    assert plain["count"] == len(engine.encode_messages(messages, add_generation_prompt=False))
    both = httpx.post(root + "/tokenize", json={"messages": messages, "continue_final_message": True},
                      headers=headers, timeout=30)                        # with the generation prompt: a 400
    assert both.status_code == 400 and "not compatible" in both.json()["error"]["message"]


def test_llama_index_kvboost_sends_document_parts(served):
    from kvboost_integrations.llama_index import KVBoost
    from kvboost_integrations.llama_index.messages import document_message
    engine, server, received = served
    messages = [document_message("user", [(DOCS[1], True), (QUESTION, False)])]
    expected = KVBoost(engine=engine, max_new_tokens=10, document_order="relevance").chat(messages)
    received.clear()
    llm = KVBoost(endpoint=server.url, api_key=KEY, max_new_tokens=10)
    reply = llm.chat(messages)
    assert reply.message.content == expected.message.content
    assert [part["type"] for part in received[-1][-1]["content"]] == ["document", "text"]
    llm.engine.close()


def test_other_servers_get_documents_as_text():
    with FakeServer(kind="vllm") as fake:
        engine = RemoteEngine(fake.url)
        ChatKVBoost(engine=engine, max_tokens=4).invoke(rag_messages())
        sent = [r for r in fake.requests if r["path"] == "/v1/chat/completions"][-1]["messages"]
        assert sent[-1]["content"] == "\n\n".join([*DOCS, QUESTION])
        engine.close()
