"""What LangChain and LlamaIndex code does with a chat model beyond invoke/chat (from a review of the
framework classes): per-call None, zero bound tools, LangChain's stream= routing flag, pickling and
copying (multiprocessing pipelines, Runnable copies), and over an endpoint: stop strings beside a
forced output, and a context_window the server does not report."""
from __future__ import annotations

import copy
import pickle
from typing import Literal

import pytest
from pydantic import BaseModel

pytest.importorskip("langchain_core")
pytest.importorskip("llama_index.core")

from llama_index.core import PromptTemplate  # noqa: E402
from llama_index.core.base.llms.types import ChatMessage  # noqa: E402

from fake_openai_server import FakeServer  # noqa: E402
from kvboost_engine import Engine, InputError  # noqa: E402
from kvboost_integrations.langchain import ChatKVBoost  # noqa: E402
from kvboost_integrations.llama_index import KVBoost  # noqa: E402


class City(BaseModel):
    name: Literal["Oslo", "Paris"]


def get_weather(city: str) -> str:
    """Weather of a city."""
    return "sunny"


@pytest.fixture(scope="module")
def engine(smol):
    engine = Engine(*smol)
    yield engine
    engine.close()


def test_a_per_call_none_keeps_the_instance_setting(engine):
    llm = ChatKVBoost(engine=engine, max_tokens=4, temperature=0)
    reply = llm.invoke("Count from 1 to 50", max_tokens=None)
    assert reply.usage_metadata["output_tokens"] == 4             # was the engine default (256)


def test_zero_bound_tools_and_the_stream_flag(engine):
    llm = ChatKVBoost(engine=engine, max_tokens=3, temperature=0)
    plain = llm.invoke("Hi").content
    assert llm.bind_tools([]).invoke("Hi").content == plain
    assert llm.bind(tool_choice="auto").invoke("Hi").content == plain
    assert llm.invoke("Hi", stream=True).content == llm.invoke("Hi", stream=False).content == plain
    assert llm.bind(stream=False).invoke("Hi").content == plain
    with pytest.raises(ValueError, match="no tools are bound"):
        llm.bind_tools([], tool_choice="any").invoke("Hi")


def test_a_stop_string_given_to_the_constructor_is_one_stop(engine):
    """As ChatOpenAI(stop="\\n") and the engine take it (a pydantic error before); LangSmith's ls_stop too."""
    from kvboost_integrations.langchain import KVBoostLLM
    prompt = "Write a short poem about the sea."
    full = ChatKVBoost(engine=engine, max_tokens=12).invoke(prompt).content
    stop = full.split()[2]
    expected = full[:full.index(stop)]
    assert ChatKVBoost(engine=engine, max_tokens=12, stop=stop).invoke(prompt).content == expected
    assert ChatKVBoost(stop=stop)._get_ls_params()["ls_stop"] == [stop]
    assert KVBoostLLM(stop=stop).stop == KVBoost(stop=stop).stop == [stop]
    assert KVBoost(engine=engine, max_new_tokens=12, stop=stop).chat([ChatMessage(role="user", content=prompt)]
                                                                     ).message.content == expected


def test_message_names_reach_the_chat_template_as_over_the_server():
    """ChatOpenAI and LlamaIndex's OpenAI send a message's name; the engine and our server pass it to
    the template (which may render it): the classes dropped it, so a template that renders names got
    another prompt locally than over the server."""
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from kvboost_integrations.langchain.messages import to_engine_messages as lc_messages
    from kvboost_integrations.llama_index.messages import to_engine_messages as li_messages
    given = [HumanMessage("Hi", name="Alice"), AIMessage("Hello", name="Bot"), HumanMessage("Who am I?")]
    for native in (False, True):
        assert [m.get("name") for m in lc_messages(given, native_tools=native)] == ["Alice", "Bot", None]
    assert "name" not in lc_messages([ToolMessage("4", tool_call_id="c1", name="add")], native_tools=False)[0]
    li = li_messages([ChatMessage(role="user", content="Hi", additional_kwargs={"name": "Alice"}),
                      ChatMessage(role="user", content="Who am I?")])
    assert [m.get("name") for m in li] == ["Alice", None]
    from kvboost_engine.serve.protocol import Call                 # the server, with tools: the same rule
    from kvboost_engine.serve.tools import prepare_tools
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}
    for native in (False, True):
        wire = [{"role": "user", "content": "Hi", "name": "Alice"}, {"role": "user", "content": "Who am I?"}]
        call = Call("chat", None, wire)
        prepare_tools(call, [tool], "auto", _Tokenizer("{{ tools }}" if native else "plain"))
        assert [m.get("name") for m in call.payload if m["role"] == "user"] == ["Alice", None]


class _Tokenizer:
    def __init__(self, template: str):
        self.chat_template, self.name_or_path = template, "t"


def test_pickling_and_copying_the_langchain_class(engine):
    llm = ChatKVBoost(max_tokens=3, temperature=0, stop=["\n\n"], logit_bias={5: -1.0})
    first = llm.invoke("Hi").content                               # the engine is loaded now
    again = pickle.loads(pickle.dumps(llm))
    assert again.invoke("Hi").content == first and again.get_engine() is llm.get_engine()   # the shared one
    twin = copy.deepcopy(llm)
    assert twin.get_engine() is llm.get_engine() and twin.stop == llm.stop and twin.stop is not llm.stop
    assert twin.logit_bias == llm.logit_bias and twin.logit_bias is not llm.logit_bias       # a deep copy
    given = ChatKVBoost(engine=engine)
    assert copy.deepcopy(given).get_engine() is engine
    with pytest.raises(TypeError, match=r"engine=.*cannot be pickled"):
        pickle.dumps(given)


def test_pickling_and_copying_the_llama_index_class(engine):
    llm = KVBoost(max_new_tokens=3)
    message = [ChatMessage(role="user", content="Hi")]
    first = llm.chat(message).message.content
    again = pickle.loads(pickle.dumps(llm))
    assert llm._engine is not None                                 # pickling left the instance as it was
    assert not again._custom_messages_to_prompt and not again._custom_completion_to_prompt   # the chat template
    reply = again.chat(message)
    assert reply.message.content == first and again.engine is llm.engine
    assert reply.raw["usage"]["prompt_tokens"] == llm.chat(message).raw["usage"]["prompt_tokens"]
    twin = copy.deepcopy(KVBoost(max_new_tokens=3, additional_kwargs={"top_k": 5}))
    deep = copy.deepcopy(llm)
    assert deep.engine is llm.engine and twin.additional_kwargs == {"top_k": 5}
    twin.additional_kwargs["top_k"] = 7
    assert copy.deepcopy(twin).additional_kwargs is not twin.additional_kwargs
    given = KVBoost(engine=engine, max_new_tokens=3)
    assert copy.deepcopy(given).engine is engine
    with pytest.raises(TypeError, match=r"engine=.*cannot be pickled"):      # a copy quietly used another engine
        pickle.dumps(given)


def test_over_an_endpoint_a_context_window_given_is_used():
    with FakeServer(kind="library") as server:                     # a generic server: reports no window
        llm = KVBoost(endpoint=server.url, context_window=2048, max_new_tokens=4)
        assert llm.metadata.context_window == 2048
        said = llm.predict(PromptTemplate("Say hi"))                # (cut at 4 tokens)
        assert said and server.reply.startswith(said)
    with FakeServer(kind="vllm", context_window=4096) as server:   # one that reports it bounds it
        assert KVBoost(endpoint=server.url, context_window=2048).metadata.context_window == 2048
        with pytest.raises(InputError, match="beyond the model's context window of 4096"):
            KVBoost(endpoint=server.url, context_window=16384).metadata


def test_over_an_endpoint_stop_strings_do_not_reach_a_forced_output(smol):
    """With the embedded engine a grammar decides where constrained output ends; over an endpoint
    the stop strings were sent with it (our server refuses the pair, 400; vLLM cuts the JSON)."""
    pytest.importorskip("starlette")
    from kvboost_engine.serve import Server, create_app
    engine = Engine(*smol)
    with Server(create_app(engine)) as server:
        chat = ChatKVBoost(endpoint=server.url, max_tokens=12, stop=["\n"], temperature=0)
        assert chat.with_structured_output(City).invoke("Name a city in France.").name in ("Oslo", "Paris")
        forced = chat.bind_tools([get_weather], tool_choice="any").invoke("Weather in Oslo?")
        assert forced.tool_calls or forced.response_metadata.get("finish_reason") == "length"
        llm = KVBoost(endpoint=server.url, max_new_tokens=12, stop=["\n"], temperature=0)
        assert llm.structured_predict(City, PromptTemplate("Name a city in France.")).name in ("Oslo", "Paris")
    engine.close()


def test_a_custom_messages_to_prompt_is_used(engine):
    """HuggingFaceLLM builds its chat prompt with messages_to_prompt; ours accepted it and never called it."""
    calls = []

    def my_format(messages):
        calls.append(len(messages))
        return "".join(f"<{m.role.value}>{m.content}\n" for m in messages) + "<assistant>"

    llm = KVBoost(engine=engine, max_new_tokens=3, messages_to_prompt=my_format)
    reply = llm.chat([ChatMessage(role="user", content="Hi")])
    assert calls == [1]
    assert reply.raw["usage"]["prompt_tokens"] == engine.count_tokens("<user>Hi\n<assistant>")
    assert llm.complete("Hi").text and calls == [1]              # complete() has completion_to_prompt


@pytest.mark.parametrize("options, match", [
    (dict(moved_reuse="fast"), "moved_reuse must be one of"), (dict(chunk_tokens=0), "chunk_tokens"),
    (dict(device="tpu"), "device must be"), (dict(engine_kwargs={"bogus": 1}), "unknown engine option"),
    (dict(engine_kwargs={"weights": "int9"}), "weights must be one of"),
    (dict(engine_kwargs={"kv_dtype": "float8"}), "kv_dtype")])
def test_a_bad_engine_option_is_refused_when_the_class_is_built(options, match):
    """They were checked only when the engine loaded, at the first call (sampling values were refused
    at construction, as the README says of every parameter)."""
    for cls in (ChatKVBoost, KVBoost):
        with pytest.raises(ValueError, match=match):
            cls(**options)
    assert ChatKVBoost(cache_bytes=2**20, engine_kwargs={"weights": "int4"})._engine is None     # nothing loaded
