"""Faults of a replica against `endpoint=[bad, good]`, for ChatKVBoost, KVBoostLLM and LlamaIndex
KVBoost: before the first token reaches the caller the request fails over (and the bad replica is
avoided afterwards); after it, a ReplyInterruptedError names the replica; never a shorter answer,
and always within the configured timeouts (0.5 s here)."""
from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("openai")
pytest.importorskip("langchain_core")
pytest.importorskip("llama_index.core")

from fake_openai_server import Chaos, Fault, FakeServer, tokens  # noqa: E402
from langchain_core.messages import HumanMessage, SystemMessage  # noqa: E402
from llama_index.core.base.llms.types import ChatMessage  # noqa: E402

from kvboost_integrations.langchain import ChatKVBoost, KVBoostLLM  # noqa: E402
from kvboost_integrations.llama_index import KVBoost  # noqa: E402
from kvboost_integrations.remote import (  # noqa: E402
    BadReplyError,
    EngineClosedError,
    RemoteEngine,
    RemoteGeneration,
    ReplicaUnavailableError,
    ReplyInterruptedError,
)
from kvboost_integrations.remote.generation import ReplyState  # noqa: E402

TIMEOUT_S = 0.5
FAST = {"connect_timeout_s": TIMEOUT_S, "read_timeout_s": TIMEOUT_S, "cooldown_s": 60}
SLACK_S = 5             # a loaded 2-core machine (0.7-1.2 s measured; the hang is what is caught): time beyond the timeout a failing request may take
BEFORE_FIRST_TOKEN = [Fault("hang"), Fault("drop"), Fault("non_json"), Fault("malformed"), Fault("error"),
                      Fault("error", status=429), Fault("hang", paths="*"), Fault("drop", paths="*")]
AFTER_FIRST_TOKEN = [Fault("hang", after_chunks=3), Fault("drop", after_chunks=3), Fault("malformed", after_chunks=3),
                     Fault("no_finish"), Fault("slow", delay_s=4 * TIMEOUT_S)]


def fault_id(fault: Fault) -> str:
    return f"{fault.mode}-{fault.after_chunks}-{fault.status}-{'all' if fault.paths == '*' else 'completions'}"


@pytest.fixture
def pair():
    with FakeServer() as bad, FakeServer() as good:
        yield bad, good


class Caller:
    """One framework class over [bad, good], with the bad replica tried first (the good one is
    cooling down from an earlier failure), and its reply's text and telemetry."""

    def __init__(self, kind: str, bad: FakeServer, good: FakeServer, **options):
        self.kind = kind
        endpoints = dict(endpoint=[bad.url, good.url], served_model="fake-model", engine_kwargs={**FAST, **options})
        if kind == "llama_index":
            self.llm = KVBoost(**endpoints, max_new_tokens=32)
            self.engine = self.llm.engine
        else:
            self.llm = (ChatKVBoost if kind == "chat" else KVBoostLLM)(**endpoints, max_tokens=32)
            self.engine = self.llm.get_engine()
        self.engine.router.mark_down(good.url)

    def ask(self, question: str = "Hi") -> tuple[str, dict]:
        if self.kind == "chat":
            message = self.llm.invoke(question)
            return message.content, message.response_metadata
        if self.kind == "text":
            info = self.llm.generate([question]).generations[0][0]
            return info.text, info.generation_info
        response = self.llm.chat([ChatMessage(role="user", content=question)])
        return response.message.content, response.raw["kvboost"]


KINDS = ("chat", "text", "llama_index")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fault", BEFORE_FIRST_TOKEN, ids=fault_id)
def test_a_fault_before_the_first_token_fails_over_and_the_replica_is_avoided(pair, kind, fault):
    bad, good = pair
    bad.fault = fault
    caller = Caller(kind, bad, good)
    started = time.monotonic()
    text, meta = caller.ask()
    assert time.monotonic() - started < TIMEOUT_S + SLACK_S
    assert (text, meta["replica"], meta["finish_reason"]) == (good.reply, good.url, "stop")
    # a fault on every path may strike first in a lookup before the request (LlamaIndex reads metadata)
    assert meta["failovers"] == [bad.url] or (fault.paths == "*" and meta["failovers"] == [])
    assert caller.engine.router.state()[bad.url]["down"] and not caller.engine.router.state()[good.url]["down"]
    tried = len(bad.requests)
    text, meta = caller.ask("Again")
    assert (text, meta["replica"], meta["failovers"], len(bad.requests)) == (good.reply, good.url, [], tried)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fault", AFTER_FIRST_TOKEN, ids=fault_id)
def test_a_fault_after_the_first_token_is_a_clear_error_naming_the_replica(pair, kind, fault):
    bad, good = pair
    bad.fault = fault
    caller = Caller(kind, bad, good)
    started = time.monotonic()
    with pytest.raises(ReplyInterruptedError, match="reached the caller") as raised:
        caller.ask()
    assert time.monotonic() - started < TIMEOUT_S + SLACK_S
    assert raised.value.replica == bad.url and bad.url in str(raised.value) and raised.value.received_chars > 0
    assert good.completions() == 0                               # no second, different reply
    assert caller.engine.router.state()[bad.url]["down"]
    text, meta = caller.ask("Again")
    assert (text, meta["replica"], meta["failovers"]) == (good.reply, good.url, [])


def test_the_error_says_what_happened(pair):
    bad, good = pair
    cases = {Fault("hang"): "no data for read_timeout_s=0.5 s", Fault("drop"): "Server disconnected",
             Fault("malformed"): "malformed stream chunk", Fault("non_json"): "without a finish_reason",
             Fault("error"): "HTTP 503", Fault("drop", after_chunks=3): "incomplete chunked read",
             Fault("no_finish"): "without a finish_reason"}
    for fault, words in cases.items():
        bad.fault = good.fault = fault
        engine = RemoteEngine([bad.url, good.url], served_model="fake-model", **FAST)
        with pytest.raises((ReplicaUnavailableError, ReplyInterruptedError), match=words) as raised:
            engine.chat([{"role": "user", "content": "Hi"}])
        if isinstance(raised.value, ReplicaUnavailableError):
            assert set(raised.value.errors) == {bad.url, good.url}


def test_slow_but_within_the_read_timeout_is_not_a_fault(pair):
    bad, good = pair
    bad.fault = Fault("slow", delay_s=TIMEOUT_S / 10)
    text, meta = Caller("chat", bad, good).ask()
    assert (text, meta["replica"], meta["failovers"]) == (bad.reply, bad.url, [])


def test_streaming_callers_get_the_text_then_the_error(pair):
    bad, good = pair
    bad.fault = Fault("drop", after_chunks=3)
    chunks = []
    with pytest.raises(ReplyInterruptedError, match=bad.url):
        for chunk in Caller("chat", bad, good).llm.stream("Hi"):
            chunks.append(chunk.content)
    assert "".join(chunks) == "The answer"


def test_the_async_client_fails_over_and_raises_the_same_way(pair):
    bad, good = pair
    engine = RemoteEngine([bad.url, good.url], served_model="fake-model", **FAST)

    async def ask():
        items = [item async for item in engine.astream_chat([{"role": "user", "content": "Hi"}])]
        return items[-1]

    async def run():
        engine.router.mark_down(good.url)
        bad.fault = Fault("hang")
        first = await ask()
        engine.router.mark_up(bad.url)
        engine.router.mark_down(good.url)
        bad.fault = Fault("malformed", after_chunks=2)
        with pytest.raises(ReplyInterruptedError, match=bad.url):
            await ask()
        await engine.aclose()
        return first

    gen = asyncio.run(run())
    assert isinstance(gen, RemoteGeneration) and (gen.text, gen.failovers) == (good.reply, [bad.url])


def test_model_lookup_and_metrics_are_inside_the_timeouts(pair):
    bad, good = pair
    bad.fault = Fault("hang", paths="*")                # /v1/models and /metrics never answer either
    engine = RemoteEngine([bad.url, good.url], **FAST)
    engine.router.mark_down(good.url)
    started = time.monotonic()
    assert engine.model_name == "fake-model"
    gen = engine.chat([{"role": "user", "content": "Hi"}])
    assert gen.replica == good.url and time.monotonic() - started < TIMEOUT_S + SLACK_S
    assert engine.cache_report()["replicas"][bad.url]["failures"] == 1


def test_default_timeouts_in_both_frameworks_and_the_overall_cap(pair):
    _, good = pair
    for engine in (ChatKVBoost(endpoint=good.url).get_engine(), KVBoostLLM(endpoint=good.url).get_engine(),
                   KVBoost(endpoint=good.url).engine):
        replica = engine.replicas[good.url]
        assert (replica.connect_timeout_s, replica.read_timeout_s) == (5.0, 30.0)
        assert (replica.client.timeout.connect, replica.client.timeout.read) == (5.0, 30.0)
    capped = ChatKVBoost(endpoint=good.url, timeout=2).get_engine().replicas[good.url]
    assert (capped.connect_timeout_s, capped.read_timeout_s) == (2, 2)
    tuned = KVBoost(endpoint=good.url, engine_kwargs={"read_timeout_s": 120}).engine.replicas[good.url]
    assert tuned.client.timeout.read == 120
    with pytest.raises(ValueError, match="read_timeout_s must be a positive"):
        RemoteEngine(good.url, read_timeout_s=0)


def test_close_closes_the_async_clients(pair):
    _, good = pair
    engine = RemoteEngine(good.url, served_model="fake-model")

    async def ask():
        return [item async for item in engine.astream_chat([{"role": "user", "content": "Hi"}])][-1]

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(ask())
        client = engine.replicas[good.url]._async[loop]
        sync = engine.replicas[good.url].client
        engine.close()
        assert client.is_closed() and sync.is_closed()

        async def close_inside_the_loop():
            await ask()
            inner = engine.replicas[good.url]._async[loop]
            engine.close()                               # sync close called from async code
            await asyncio.sleep(0.05)
            return inner

        assert loop.run_until_complete(close_inside_the_loop()).is_closed()
    finally:
        loop.close()


def test_prompt_text_is_sent_as_given_by_default_and_the_opt_in_is_named(pair):
    _, good = pair
    system = "You are a helpful assistant. Today is 2026-12-01. Our support line is 1800123456."
    messages = [SystemMessage(system), HumanMessage("Hi")]
    plain = ChatKVBoost(endpoint=good.url).invoke(messages)
    assert good.requests[-1]["messages"][0] == {"role": "system", "content": system}
    assert "volatile_moved" not in plain.response_metadata
    moved = ChatKVBoost(endpoint=good.url, engine_kwargs={"volatile": "last"}).invoke(messages)
    assert good.requests[-1]["messages"][0]["content"] == "You are a helpful assistant."
    assert moved.response_metadata["volatile_moved"] == ["Today is 2026-12-01.", "Our support line is 1800123456."]
    response = KVBoost(endpoint=good.url).chat([ChatMessage(role="system", content=system),
                                                ChatMessage(role="user", content="Hi")])
    assert good.requests[-1]["messages"][0]["content"] == system and "volatile_moved" not in response.raw["kvboost"]


def test_chaos_never_gives_a_shorter_answer(pair):
    flaky, good = pair
    flaky.fault = Chaos({"hang": 0.1, "drop": 0.2, "malformed": 0.1, "non_json": 0.1, "no_finish": 0.1}, seed=5,
                        after_chunks=(0, 2))
    engine = RemoteEngine([flaky.url, good.url], served_model="fake-model", routing="round_robin",
                          connect_timeout_s=TIMEOUT_S, read_timeout_s=TIMEOUT_S, cooldown_s=0)
    outcomes = []
    for i in range(24):
        try:
            outcomes.append(engine.chat([{"role": "user", "content": f"Question {i}?"}]).text)
        except ReplyInterruptedError as err:
            assert err.replica == flaky.url
            outcomes.append("interrupted")
    assert set(outcomes) <= {good.reply, "interrupted"} and outcomes.count(good.reply) >= 12
    assert sum(flaky.fault.drawn.values()) > 0


def test_a_stream_that_breaks_after_its_finish_reason_keeps_the_reply(pair):
    bad, good = pair
    after_finish = len(tokens(bad.reply)) + 1              # every text chunk and the finish chunk, then the drop
    bad.fault = Fault("drop", after_chunks=after_finish)   # (the usage chunk and [DONE] never come)
    engine = RemoteEngine([bad.url, good.url], served_model="fake-model", **FAST)
    engine.router.mark_down(good.url)
    gen = engine.chat([{"role": "user", "content": "Hi"}])
    assert (gen.text, gen.finish_reason, gen.replica, gen.failovers) == (bad.reply, "stop", bad.url, [])
    assert not engine.router.state()[bad.url]["down"] and good.completions() == 0

    async def ask():
        return [item async for item in engine.astream_chat([{"role": "user", "content": "Hi again"}])][-1]

    gen = asyncio.run(ask())
    assert (gen.text, gen.replica) == (bad.reply, bad.url) and not engine.router.state()[bad.url]["down"]
    bad.fault = Fault("drop", after_chunks=after_finish - 1)       # before the finish chunk: incomplete
    with pytest.raises(ReplyInterruptedError, match=bad.url):
        engine.chat([{"role": "user", "content": "Hi"}])


def test_close_during_a_stream_is_not_a_replica_failure(pair):
    bad, good = pair
    good.chunk_delay_s = 0.05
    engine = RemoteEngine([good.url], served_model="fake-model", **FAST)
    stream = engine.stream_chat([{"role": "user", "content": "Hi"}])
    next(stream)
    engine.close()                                           # the connection it reads is closed under it
    with pytest.raises(EngineClosedError, match="closed during this request"):
        list(stream)
    assert not engine.router.state()[good.url]["down"]
    assert engine.cache_report()["replicas"][good.url]["failures"] == 0
    assert engine.chat([{"role": "user", "content": "Hi"}]).text == good.reply    # a later request reconnects


def test_a_chunk_of_the_wrong_shape_is_a_bad_reply_that_fails_over():
    from openai.types.chat import ChatCompletionChunk

    for choices in ([1], [{"index": 0, "delta": {"tool_calls": [5]}}]):
        chunk = ChatCompletionChunk.model_construct(id="x", object="chat.completion.chunk", created=0, model="m",
                                                    choices=choices)
        with pytest.raises(BadReplyError, match="malformed stream chunk"):
            ReplyState(0.0).feed("chat", chunk)


def test_close_from_another_event_loop_closes_the_idle_loops_client(pair):
    _, good = pair
    engine = RemoteEngine(good.url, served_model="fake-model")

    async def ask():
        return [item async for item in engine.astream_chat([{"role": "user", "content": "Hi"}])][-1]

    first = asyncio.new_event_loop()
    try:
        first.run_until_complete(ask())                   # its client belongs to `first`, open and idle
        client = engine.replicas[good.url]._async[first]

        async def close_elsewhere():
            await engine.aclose()                         # another loop runs in this thread

        asyncio.run(close_elsewhere())
        assert client.is_closed()
    finally:
        first.close()
