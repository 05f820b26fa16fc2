"""RemoteEngine and the framework classes against an in-process fake OpenAI-compatible server:
streaming, async, stop, usage and cached tokens, tools, cancellation, routing and replica failure."""
from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("openai")

from fake_openai_server import FakeServer  # noqa: E402

from kvboost_engine import InputError  # noqa: E402
from kvboost_integrations.remote import RemoteEngine, RemoteGeneration, ReplicaUnavailableError  # noqa: E402

SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer briefly."}


def ask(question: str) -> list[dict]:
    return [SYSTEM, {"role": "user", "content": question}]


@pytest.fixture
def server():
    with FakeServer() as fake:
        yield fake


@pytest.fixture
def pair():
    with FakeServer() as a, FakeServer() as b:
        yield a, b


def test_stream_deltas_then_generation_with_usage_and_cached_tokens(server):
    engine = RemoteEngine(server.url)
    stream = engine.stream_chat(ask("Hi"), max_new_tokens=32)
    deltas = list(stream)
    gen = stream.generation
    assert isinstance(gen, RemoteGeneration) and "".join(deltas) == gen.text == server.reply
    assert gen.finish_reason == "stop" and gen.completion_tokens == len(deltas) and gen.prompt_tokens > 10
    assert gen.reused_tokens == 0 and gen.replica == server.url and gen.served_model == "fake-model"
    again = engine.chat(ask("Hi again"), max_new_tokens=32)
    assert again.reused_tokens > 10 and again.reused_exact == again.reused_tokens
    assert again.telemetry()["server_cached_tokens"] == again.reused_tokens
    body = server.requests[-1]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 32 and body["top_k"] == -1


def test_stop_and_length_and_sampling_parameters_reach_the_server(server):
    engine = RemoteEngine(server.url)
    assert engine.chat(ask("Hi"), stop=["42"]).text == "The answer is "
    short = engine.chat(ask("Hi"), max_new_tokens=3, temperature=0.7, top_p=0.9, top_k=5, seed=3)
    assert short.finish_reason == "length" and short.text == "The answer"
    body = server.requests[-1]
    assert (body["temperature"], body["top_p"], body["top_k"], body["seed"]) == (0.7, 0.9, 5, 3)
    with pytest.raises(InputError, match="unknown sampling"):
        engine.chat(ask("Hi"), beams=2)


def test_completion_for_plain_prompts(server):
    gen = RemoteEngine(server.url).generate("Once upon a time", max_new_tokens=2)
    assert gen.text == "The " and server.requests[-1]["path"] == "/v1/completions"
    assert server.requests[-1]["prompt"] == "Once upon a time"


def test_async_stream_on_the_event_loop(server):
    engine = RemoteEngine(server.url)

    async def run():
        return [item async for item in engine.astream_chat(ask("Hi"))]

    items = asyncio.run(run())
    assert "".join(items[:-1]) == server.reply and isinstance(items[-1], RemoteGeneration)


def test_cancel_stops_reading(server):
    server.chunk_delay_s = 0.05
    stream = RemoteEngine(server.url).stream_chat(ask("Hi"))
    first = next(stream)
    stream.cancel()
    rest = list(stream)
    assert first and len(rest) <= 1 and stream.generation.finish_reason == "cancelled"


def test_close_ends_the_request_and_an_unstarted_stream_sends_nothing(server):
    server.chunk_delay_s = 0.05
    engine = RemoteEngine(server.url)
    engine.model_name                                          # the model lookup is not a completion
    engine.stream_chat(ask("Hi")).close()
    assert not [r for r in server.requests if r["path"] == "/v1/chat/completions"]
    stream = engine.stream_chat(ask("Hi"))
    assert next(stream)
    stream.close()                                             # returns once the request has ended
    assert stream.generation.finish_reason == "cancelled" and stream.generation.text != server.reply


def test_order_documents_counts_what_the_layout_will_put_first(server):
    engine = RemoteEngine(server.url)
    docs = [{"type": "document", "text": t} for t in ("A doc", "B doc", "C doc")]
    engine.chat([SYSTEM, {"role": "user", "content": docs + [{"type": "text", "text": "Which?"}]}])
    again = [SYSTEM, {"role": "user", "content": [docs[1], docs[0], {"type": "text", "text": "Which?"}]}]
    assert engine.order_documents(again) == (again, 2)


def test_tools_pass_through_and_tool_calls_come_back(server):
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    gen = RemoteEngine(server.url).chat(ask("Weather in Paris?"), tools=tools, tool_choice="any")
    assert server.requests[-1]["tools"] == tools and server.requests[-1]["tool_choice"] == "required"
    assert gen.finish_reason == "tool_calls"
    assert gen.tool_calls == [{"id": "call_fake", "index": 0, "name": "weather", "arguments": '{"city": "Paris"}',
                               "args": {"city": "Paris"}}]


def test_a_replica_that_is_down_is_skipped_and_marked(pair):
    a, b = pair
    engine = RemoteEngine([a.url, b.url], cooldown_s=3600)      # still cooling down at the third chat
    owner = engine.chat(ask("Hi")).replica
    dead, alive = (a, b) if owner == a.url else (b, a)
    dead.stop()
    gen = engine.chat(ask("Hi"))
    assert gen.replica == alive.url and gen.failovers == [dead.url]
    assert engine.router.state()[dead.url]["down"]
    assert engine.chat(ask("Hi")).failovers == []            # tried last while it cools down
    report = engine.cache_report()
    assert report["replicas"][dead.url]["failures"] == 1 and report["total"]["requests"] == 3


def test_a_failing_replica_answering_503_is_skipped(pair):
    a, b = pair
    a.fail_with = b.fail_with = 503
    engine = RemoteEngine([a.url, b.url], served_model="fake-model")
    with pytest.raises(ReplicaUnavailableError, match="no replica answered") as err:
        engine.chat(ask("Hi"))
    assert a.url in str(err.value) and b.url in str(err.value)
    b.fail_with = None
    assert engine.chat(ask("Hi")).replica == b.url


def test_a_bad_request_is_raised_not_retried(pair):
    a, b = pair
    engine = RemoteEngine([a.url, b.url], served_model="no-such-model")
    import openai
    with pytest.raises(openai.NotFoundError):
        engine.chat(ask("Hi"))
    assert len(a.requests) + len(b.requests) == 1


def test_no_replica_at_all_is_a_clear_error():
    with FakeServer() as gone:
        url = gone.url
    with pytest.raises(ReplicaUnavailableError, match=r"connection failed \(ConnectError: .*refused"):
        RemoteEngine(url, served_model="fake-model").chat(ask("Hi"))


def test_cache_aware_routing_keeps_conversations_on_their_replica_round_robin_scatters_them(pair):
    a, b = pair
    results = {}
    for policy in ("cache", "round_robin"):
        engine = RemoteEngine([a.url, b.url], routing=policy)
        conversations = [ask(f"Conversation {i} starts here with a question.") for i in range(5)]
        for turn in range(3):
            for messages in conversations:
                reply = engine.chat(messages).text
                messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"And {turn}?"}]
        results[policy] = engine.cache_report()["total"]["hit_rate"]
        a.prompts.clear()
        b.prompts.clear()
    assert results["cache"] > results["round_robin"] + 0.05


def test_metrics_stand_in_when_usage_has_no_cached_tokens():
    with FakeServer(report_cached=False) as server:
        engine = RemoteEngine(server.url)
        engine.chat(ask("Hi"))                  # learns that usage has no cached tokens
        gen = engine.chat(ask("Hi there"))
        assert gen.server["source"] == "metrics" and gen.reused_tokens > 10
        report = engine.cache_report()
        assert report["replicas"][server.url]["server"]["hits"] == gen.reused_tokens


def test_tokens_context_window_and_model_from_the_server(server):
    engine = RemoteEngine(server.url)
    assert engine.model_name == "fake-model" and engine.context_window == 4096
    assert engine.count_tokens("one two") == 3 and engine.tokenizer("one two")["input_ids"] == [0, 1, 2]
    assert engine.count_tokens(ask("Hi")) > 10
    prompt = engine.encode_messages([SYSTEM, {"role": "user", "content": [
        {"type": "document", "text": "A doc"}, {"type": "text", "text": "Q?"}]}])
    assert prompt.chunk_kinds == ["system", "document", "message"]
    assert RemoteEngine(server.url, context_window=100).context_window == 100


def test_report_text(server):
    engine = RemoteEngine(server.url)
    engine.chat(ask("Hi"))
    engine.chat(ask("Hi"))
    text = engine.format_cache_report()
    assert server.url in text and "total" in text and "%" in text


def test_endpoint_input_errors():
    with pytest.raises(InputError, match="http"):
        RemoteEngine("127.0.0.1:8000")
    with pytest.raises(InputError, match="at least one"):
        RemoteEngine([])
