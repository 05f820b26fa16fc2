"""Our server's fields as the reviewers broke them: tool calls whose arguments hold `</tool_call>` or
are not JSON, `parallel_tool_calls=false`, a negative `seed`, context-window errors in the client's
terms, `stream_options.continuous_usage_stats`, and completions' `text_offset`."""
from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from kvboost_engine import Engine, Generation  # noqa: E402
from kvboost_engine.serve import Server, create_app  # noqa: E402
from kvboost_engine.serve.protocol import BadRequest, engine_parameters, parse_chat  # noqa: E402
from kvboost_engine.serve.replies import Reply  # noqa: E402
from kvboost_engine.serve.tools import ToolReply  # noqa: E402
from kvboost_engine.toolcalls import HERMES  # noqa: E402

ASK = [{"role": "user", "content": "Save it."}]
TWO_CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')


@pytest.fixture(scope="module")
def server(smol):
    engine = Engine(*smol, cache_bytes=128 * 2**20)
    with Server(create_app(engine, model_name="smol")) as served:
        yield served
    engine.close()


def _chat(server, **body):
    return httpx.post(server.url + "/chat/completions", json={"messages": ASK, **body}, timeout=120)


def test_a_forced_call_with_a_closing_tag_in_its_argument_comes_back_as_json(server):
    """The server returned finish_reason tool_calls with arguments cut at the `</tool_call>` inside
    the argument: not JSON."""
    tools = [{"type": "function", "function": {"name": "save_snippet", "parameters": {
        "type": "object", "properties": {"text": {"enum": ["a</tool_call>b"]}}, "required": ["text"]}}}]
    reply = _chat(server, tools=tools, tool_choice="required", temperature=0, max_tokens=60).json()
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert [json.loads(c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == [
        {"text": "a</tool_call>b"}]


def test_a_call_whose_arguments_are_not_json_stays_text():
    """A call with prose for arguments was returned as a tool call (arguments not JSON)."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": "Rome, please"}\n</tool_call>'
    reply = ToolReply(HERMES)
    shown = reply.feed(text)
    rest, calls = reply.finish(cut=False)
    assert calls == [] and shown + rest == text


def test_parallel_tool_calls_false_keeps_the_first_call():
    """parallel_tool_calls was accepted and ignored: a reply with two calls returned both."""
    accepted = engine_parameters()
    assert parse_chat({"messages": ASK, "parallel_tool_calls": False}, accepted).one_call
    assert not parse_chat({"messages": ASK, "parallel_tool_calls": True}, accepted).one_call
    with pytest.raises(BadRequest) as refused:
        parse_chat({"messages": ASK, "parallel_tool_calls": "no"}, accepted)
    assert refused.value.param == "parallel_tool_calls"
    for one_call, expected in ((True, ['{"city": "Rome"}']), (False, ['{"city": "Rome"}', '{"city": "Paris"}'])):
        reply = Reply("chat", "smol", ToolReply(HERMES, one_call))
        message = reply.complete(Generation(text=TWO_CALLS, finish_reason="stop"))["choices"][0]["message"]
        assert [c["function"]["arguments"] for c in message["tool_calls"]] == expected
    broken_second = TWO_CALLS.replace('{"city": "Paris"}', "Paris")       # the first call kept all the same
    message = Reply("chat", "smol", ToolReply(HERMES, True)).complete(
        Generation(text=broken_second, finish_reason="stop"))["choices"][0]["message"]
    assert [c["function"]["arguments"] for c in message["tool_calls"]] == ['{"city": "Rome"}']


def test_a_negative_seed_is_a_signed_64_bit_seed(server):
    """A negative seed was a 400 ("seed must be None or an int in [0, 2**64)"); OpenAI types it as a
    signed 64-bit int and vLLM takes negatives."""
    accepted = engine_parameters()
    assert parse_chat({"messages": ASK, "seed": -1}, accepted).params["seed"] == 2**64 - 1
    assert parse_chat({"messages": ASK, "seed": -2**63}, accepted).params["seed"] == 2**63
    for seed in (-2**63 - 1, 2**64):
        with pytest.raises(BadRequest) as refused:
            parse_chat({"messages": ASK, "seed": seed}, accepted)
        assert refused.value.param == "seed"
    assert _chat(server, seed=-1, max_tokens=3).status_code == 200


def test_context_window_errors_name_the_clients_field(smol):
    """A reply budget past the window was refused naming the engine's `max_new_tokens`, with param null."""
    from transformers import AutoTokenizer

    from kvboost_engine.loading import default_model_dir
    from tiny_models import tiny_model
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    engine = Engine(tiny_model("llama", max_position_embeddings=256), tokenizer)
    with Server(create_app(engine, model_name="tiny")) as served:
        for field in ("max_tokens", "max_completion_tokens"):
            error = _chat(served, **{field: 9000}).json()["error"]
            assert error["param"] == field and error["code"] == "context_length_exceeded"
            assert f"{field} is 9000" in error["message"] and "max_new_tokens" not in error["message"]
        long = "one two three four five " * 80
        error = httpx.post(served.url + "/completions", json={"prompt": long}, timeout=60).json()["error"]
        assert error["param"] == "prompt" and "no room for a reply" in error["message"]
        error = _chat(served, messages=[{"role": "user", "content": long}]).json()["error"]
        assert error["param"] == "messages" and "max_new_tokens" not in error["message"]
        error = _chat(served, messages=[{"role": "user", "content": long}], max_tokens=5).json()["error"]
        assert error["param"] == "messages"         # no budget would fit: the prompt is what to change
    engine.close()


def test_continuous_usage_stats_is_refused_by_name(server):
    """stream_options.continuous_usage_stats=true was validated and then ignored (usage only at the end)."""
    reply = _chat(server, max_tokens=3, stream=True, stream_options={"continuous_usage_stats": True})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "stream_options.continuous_usage_stats"
    assert _chat(server, max_tokens=3, stream=True, stream_options={"continuous_usage_stats": False}).status_code == 200


class _Delta(str):
    logprobs: list


def _entry(token: str, raw: bytes) -> dict:
    return {"token": token, "token_id": 0, "logprob": -0.1, "bytes": list(raw), "top_logprobs": []}


def test_text_offset_is_each_tokens_place_in_the_reply_text():
    """text_offset summed len() of each token's text (a part of a character counts its U+FFFD as
    one character) and restarted at 0 in every streamed chunk."""
    middle = "中".encode()                 # one character, written by two tokens
    entries = [_entry("a", b"a"), _entry("\ufffd", middle[:2]), _entry("\ufffd", middle[2:]), _entry("b", b"b")]
    whole = Reply("completion", "smol").complete(Generation(text="a中b", finish_reason="stop", logprobs=entries))
    assert whole["choices"][0]["logprobs"]["text_offset"] == [0, 1, 1, 2]
    reply, offsets = Reply("completion", "smol"), []
    for text, part in (("a", entries[:2]), ("中b", entries[2:])):
        delta = _Delta(text)
        delta.logprobs = part
        offsets += reply.delta_chunks(delta)[0]["choices"][0]["logprobs"]["text_offset"]
    assert offsets == [0, 1, 1, 2]
