"""Token counting with the model's own tokenizer, offline: LangChain's get_token_ids /
get_num_tokens / get_num_tokens_from_messages (chat template and tools included), trim_messages,
and the same over an endpoint (the server's /tokenize)."""
import socket
import time

import pytest

pytest.importorskip("langchain_core")

import langchain_core.language_models.base as lc_base  # noqa: E402
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, trim_messages  # noqa: E402
from langchain_core.tools import tool  # noqa: E402

from kvboost_engine import Engine  # noqa: E402
from kvboost_integrations.langchain import ChatKVBoost, KVBoostLLM  # noqa: E402
from fake_openai_server import FakeServer, render, tokens  # noqa: E402


@pytest.fixture(scope="module")
def lc_engine(smol):
    model, tokenizer = smol
    return Engine(model, tokenizer, cache_bytes=64 * 2**20, model_name="SmolLM2-135M-Instruct")


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return "sunny"


def _no_network(monkeypatch):
    """Any download attempt (LangChain's GPT-2 fallback, a hub lookup) fails at once."""
    def refuse(*args, **kwargs):
        raise OSError("no network in this test")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(lc_base, "get_tokenizer", lambda: pytest.fail("LangChain's GPT-2 fallback was used"))


@pytest.mark.parametrize("cls", [ChatKVBoost, KVBoostLLM])
def test_token_ids_come_from_the_models_tokenizer_offline(lc_engine, cls, monkeypatch):
    _no_network(monkeypatch)
    llm = cls(engine=lc_engine)
    began = time.perf_counter()
    expected = lc_engine.tokenizer("hello world", add_special_tokens=False)["input_ids"]
    assert llm.get_token_ids("hello world") == expected and len(expected) == 2
    assert llm.get_num_tokens("hello world") == 2
    assert llm.get_num_tokens("") == 0
    assert time.perf_counter() - began < 5                  # no download retries


def test_custom_get_token_ids_is_honoured(lc_engine):
    llm = ChatKVBoost(engine=lc_engine, custom_get_token_ids=lambda text: [7] * len(text))
    assert llm.get_num_tokens("abc") == 3


def test_message_count_is_the_prompt_the_model_receives(lc_engine, monkeypatch):
    _no_network(monkeypatch)
    chat = ChatKVBoost(engine=lc_engine, max_tokens=2)
    messages = [SystemMessage("Be brief."), HumanMessage("Hi"), AIMessage("Hello!"), HumanMessage("Colours?")]
    counted = chat.get_num_tokens_from_messages(messages)
    assert counted == chat.invoke(messages).usage_metadata["input_tokens"]
    assert chat.get_num_tokens_from_messages([]) == 0


def test_message_count_includes_the_tools(lc_engine):
    chat = ChatKVBoost(engine=lc_engine, max_tokens=2)
    messages = [HumanMessage("Weather in Paris?")]
    with_tools = chat.get_num_tokens_from_messages(messages, tools=[get_weather])
    assert with_tools > chat.get_num_tokens_from_messages(messages) + 20        # the schema is in the prompt
    assert with_tools == chat.bind_tools([get_weather]).invoke(messages).usage_metadata["input_tokens"]


def test_trim_messages_keeps_a_history_inside_the_window(lc_engine):
    chat = ChatKVBoost(engine=lc_engine, max_tokens=4)
    history = [SystemMessage("You are a terse assistant.")]
    for turn in range(30):
        history += [HumanMessage(f"Question {turn}: what is {turn} plus {turn}?"), AIMessage(f"It is {2 * turn}.")]
    history.append(HumanMessage("And what is 7 times 6?"))
    budget = 120
    assert chat.get_num_tokens_from_messages(history) > 3 * budget
    kept = trim_messages(history, max_tokens=budget, token_counter=chat, strategy="last", include_system=True,
                         start_on="human")
    assert kept[0] == history[0] and kept[-1] == history[-1] and 3 < len(kept) < len(history)
    assert chat.get_num_tokens_from_messages(kept) <= budget
    longer = [kept[0], *history[len(history) - len(kept) - 1:]]       # one more message would not fit
    assert chat.get_num_tokens_from_messages(longer) > budget
    assert chat.invoke(kept).usage_metadata["input_tokens"] <= budget


def test_counting_over_an_endpoint_asks_the_servers_tokenizer():
    with FakeServer() as server:
        chat = ChatKVBoost(endpoint=server.url)
        assert chat.get_num_tokens("one two") == 3
        messages = [HumanMessage("Weather in Paris?")]
        assert chat.get_num_tokens_from_messages(messages) == len(tokens(render([{"role": "user",
                                                                                  "content": "Weather in Paris?"}])))
        chat.get_num_tokens_from_messages(messages, tools=[get_weather])
        sent = [r for r in server.requests if r["path"] == "/tokenize" and "messages" in r]
        assert "tools" not in sent[0] and sent[1]["tools"][0]["function"]["name"] == "get_weather"
