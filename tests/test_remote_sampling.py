"""Sampling controls and logprobs over an endpoint: what goes on the wire, what comes back, and a
control a server kind would drop refused by name."""
import pytest

pytest.importorskip("openai")

from openai.types import Completion  # noqa: E402
from openai.types.chat import ChatCompletionChunk  # noqa: E402

from kvboost_engine import InputError, TextDelta  # noqa: E402
from kvboost_integrations.langchain import ChatKVBoost, KVBoostLLM  # noqa: E402
from kvboost_integrations.remote import RemoteEngine  # noqa: E402
from kvboost_integrations.remote.client import ServerInfo  # noqa: E402
from kvboost_integrations.remote.wire import chat_body, completion_body  # noqa: E402
from kvboost_integrations.remote.generation import ReplyState  # noqa: E402
from fake_openai_server import FakeServer  # noqa: E402

CONTROLS = dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25, min_tokens=2,
                logit_bias={5: -100}, logprobs=True, top_logprobs=2)


def test_every_control_goes_to_the_server():
    with FakeServer() as server:
        ChatKVBoost(endpoint=server.url, max_tokens=5, **CONTROLS).invoke("hi")
        body = next(r for r in server.requests if r["path"] == "/v1/chat/completions")
        assert (body["presence_penalty"], body["frequency_penalty"], body["logit_bias"]) == (0.5, 0.25, {"5": -100})
        assert (body["logprobs"], body["top_logprobs"], body["min_tokens"]) == (True, 2, 2)
        assert body["repetition_penalty"] == body["repeat_penalty"] == 1.3 and body["repeat_last_n"] == -1
        KVBoostLLM(endpoint=server.url, max_tokens=5, logprobs=True, top_logprobs=3).invoke("hi")
        assert next(r for r in server.requests if r["path"] == "/v1/completions")["logprobs"] == 3


def test_the_default_request_is_unchanged():
    body = chat_body("m", [], {"max_new_tokens": 4, "temperature": 0.0, "stop": None})
    assert set(body) == {"model", "messages", "stream", "stream_options", "max_tokens", "temperature", "extra_body"}
    assert body["extra_body"] == {"top_k": -1}          # no cut, as vLLM, SGLang and llama-server read it
    assert "logprobs" not in completion_body("m", "p", {"max_new_tokens": 4})


def test_a_call_naming_no_sampling_answers_as_the_engine_does():
    """RemoteEngine.chat() with no temperature sampled at the server's default (1.0) and, with no
    max_new_tokens, ran to the server's limit; Engine.chat() is greedy, 256 tokens."""
    import inspect
    from kvboost_engine.request.sampling import SamplingParams
    from kvboost_integrations.remote.wire import ENGINE_DEFAULTS
    defaults = inspect.signature(SamplingParams.build).parameters
    assert all(defaults[name].default == value for name, value in ENGINE_DEFAULTS.items())
    for body in (chat_body("m", [], {}), completion_body("m", "p", {})):
        assert (body["temperature"], body["max_tokens"]) == (0.0, 256)
    assert chat_body("m", [], {"temperature": 0.7})["temperature"] == 0.7


def test_earlier_thinking_alone_does_not_ask_an_unknown_server_what_it_is(monkeypatch):
    """A history with reasoning_content made RemoteEngine ask /v1/models (to know whether the server is
    ours), which a server without that endpoint answers 404: a plain request failed."""
    with FakeServer() as server:
        engine = RemoteEngine(server.url, served_model="fake-model")
        monkeypatch.setattr(engine, "server_info", lambda: pytest.fail("asked the server what it is"))
        history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", "reasoning_content": "r"},
                   {"role": "user", "content": "again"}]
        engine.chat(history, max_new_tokens=2)
        sent = next(r for r in server.requests if r["path"] == "/v1/chat/completions")["messages"]
        assert all("reasoning_content" not in m for m in sent)


def test_a_tool_call_id_mapped_twice_stays_the_one_the_local_engine_uses():
    """Mistral's 9-character ids: the client maps a call id, our server mapped it again (a sha1 of the
    mapped id), so the server's prompt differed from the local one (130 against 128 tokens)."""
    from kvboost_engine.toolcalls import native_call_id
    once = native_call_id("call_1")
    assert native_call_id(once) == once and len(once) == 9 and once != native_call_id("call_2")


def test_a_stop_string_is_one_stop_on_the_wire():
    """A plain string is one stop, as the engine and the server read it (it went out split into
    its characters: 'Observation:' stopped at the first 'O', ' and' at the first space)."""
    with FakeServer() as server:
        ChatKVBoost(endpoint=server.url, max_tokens=5).invoke("hi", stop="Observation:")
        RemoteEngine(server.url).chat([{"role": "user", "content": "hi"}], max_new_tokens=3, stop="\n\n")
        KVBoostLLM(endpoint=server.url, max_tokens=5).invoke("hi", stop=[" and", "x"])
        stops = [r.get("stop") for r in server.requests if r["path"].endswith("completions")]
        assert stops == [["Observation:"], ["\n\n"], [" and", "x"]]
    assert "stop" not in chat_body("m", [], {"stop": ""})
    with pytest.raises(InputError, match="stop must be"):
        chat_body("m", [], {"stop": [5]})


def test_a_control_llama_server_would_drop_is_refused_by_name(monkeypatch):
    with FakeServer() as server:
        engine = RemoteEngine(server.url)
        monkeypatch.setattr(engine, "server_info", lambda: ServerInfo("llamacpp", "fake-model", 4096))
        with pytest.raises(InputError, match="min_tokens"):
            ChatKVBoost(engine=engine, min_tokens=3).invoke("hi")
        with pytest.raises(InputError, match="min_tokens"):
            KVBoostLLM(engine=engine, min_tokens=3).invoke("hi")
        assert not any(r["path"].startswith("/v1/c") for r in server.requests)          # nothing was sent
        ChatKVBoost(engine=engine, repetition_penalty=1.2).invoke("hi")       # honoured: as repeat_penalty


def test_server_logprobs_come_back_on_deltas_and_the_generation():
    entry = {"token": "Hi", "logprob": -0.1, "bytes": [72, 105], "top_logprobs": []}
    chunk = ChatCompletionChunk.model_validate({
        "id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m",
        "choices": [{"index": 0, "delta": {"content": "Hi"}, "logprobs": {"content": [entry]}, "finish_reason": None}]})
    state = ReplyState(0.0)
    delta = state.feed_chat(chunk)
    assert isinstance(delta, TextDelta) and delta == "Hi" and delta.logprobs == [entry]
    assert state.generation(replica="r", model="m", cancelled=False, failovers=[]).logprobs == [entry]
    legacy = Completion.model_validate({
        "id": "x", "object": "text_completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "text": " yes", "finish_reason": "length",
                     "logprobs": {"tokens": [" yes"], "token_logprobs": [-0.5], "top_logprobs": [{" yes": -0.5, " no": -1.5}],
                                  "text_offset": [0]}}]})
    state = ReplyState(0.0)
    delta = state.feed_completion(legacy)
    assert delta.logprobs == [{"token": " yes", "logprob": -0.5, "bytes": list(b" yes"),
                               "top_logprobs": [{"token": " yes", "logprob": -0.5, "bytes": list(b" yes")},
                                                {"token": " no", "logprob": -1.5, "bytes": list(b" no")}]}]
    plain = ReplyState(0.0)
    assert type(plain.feed_completion(legacy.model_copy(update={"choices": [legacy.choices[0].model_copy(
        update={"logprobs": None})]}))) is str


def test_llama_index_sends_its_controls_to_the_server():
    pytest.importorskip("llama_index.core")
    from llama_index.core.base.llms.types import ChatMessage

    from kvboost_integrations.llama_index import KVBoost
    with FakeServer() as server:
        llm = KVBoost(endpoint=server.url, max_new_tokens=5, repetition_penalty=1.2, timeout=30,
                      additional_kwargs={"presence_penalty": 0.5, "logprobs": True})
        llm.chat([ChatMessage(role="user", content="hi")])
        body = next(r for r in server.requests if r["path"] == "/v1/chat/completions")
        assert (body["repetition_penalty"], body["presence_penalty"], body["logprobs"]) == (1.2, 0.5, True)
        assert "timeout_s" not in body


def test_reasoning_a_server_sends_apart_becomes_the_think_block_the_classes_separate():
    def chunk(delta):
        return ChatCompletionChunk.model_validate({"id": "x", "object": "chat.completion.chunk", "created": 0,
                                                   "model": "m", "choices": [{"index": 0, "delta": delta,
                                                                              "finish_reason": None}]})
    state = ReplyState(0.0)
    texts = [state.feed_chat(chunk(d)) for d in ({"reasoning_content": "Let"}, {"reasoning": " me"},
                                                   {"content": "Paris"}, {"content": "."})]
    assert texts == ["<think>\nLet", " me", "\n</think>\n\nParis", "."]
    from kvboost_integrations._reasoning import ThinkingSplitter
    splitter = ThinkingSplitter()
    parts = [splitter.feed(t) for t in texts] + [splitter.finish()]
    assert ("".join(p[0] for p in parts), "".join(p[1] for p in parts)) == ("Let me", "Paris.")
