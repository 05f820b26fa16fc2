"""Real async: work runs off the event loop, concurrent requests stay apart, cancelling stops decoding."""
import asyncio
import time

import pytest
from holds import Hold, hold_engine_streams

pytest.importorskip("langchain_core")

from kvboost_engine import Engine  # noqa: E402
from kvboost_integrations.langchain import ChatKVBoost, KVBoostLLM  # noqa: E402

PROMPTS = ["Say hello in French.", "Name a fruit.", "What is 2+2?", "Name a planet."]
STORY = "Write a very long story about a dragon who learns to bake bread."


@pytest.fixture(scope="module")
def lc_engine(smol):
    model, tokenizer = smol
    return Engine(model, tokenizer, cache_bytes=256 * 2**20)


async def test_four_concurrent_requests_get_their_own_answers(lc_engine):
    chat = ChatKVBoost(engine=lc_engine, max_tokens=6)
    expected = [chat.invoke(p).content for p in PROMPTS]
    assert len(set(expected)) > 1
    invoked = await asyncio.gather(*(chat.ainvoke(p) for p in PROMPTS))
    assert [m.content for m in invoked] == expected

    async def collect(prompt):
        return "".join([chunk.content async for chunk in chat.astream(prompt)])

    assert await asyncio.gather(*(collect(p) for p in PROMPTS)) == expected
    completions = KVBoostLLM(engine=lc_engine, max_tokens=4)
    batch = await completions.abatch(PROMPTS)
    assert batch == [completions.invoke(p) for p in PROMPTS]


async def test_generation_does_not_block_the_event_loop(lc_engine, monkeypatch):
    hold = Hold(at=2, timeout=30)                  # the request stays in flight until the loop has ticked
    hold_engine_streams(monkeypatch, hold)
    chat = ChatKVBoost(engine=lc_engine, max_tokens=8)
    ticks_while_held = 0
    done = asyncio.Event()

    async def ticker():
        nonlocal ticks_while_held
        while not done.is_set():
            if hold.reached.is_set() and not hold.release.is_set():
                ticks_while_held += 1
                if ticks_while_held == 10:
                    hold.release.set()
            await asyncio.sleep(0.01)

    task = asyncio.create_task(ticker())
    try:
        await chat.ainvoke(STORY)                  # if it blocked the loop, the hold would time out
    finally:
        hold.release.set()
        done.set()
        await task
    assert ticks_while_held == 10 and hold.advanced >= 2


async def _wait_for_request_end(engine, requests_before, timeout=30.0):
    deadline = time.monotonic() + timeout
    while engine.stats()["requests"] == requests_before and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return engine.stats()


async def test_cancelled_astream_stops_decoding_within_a_few_tokens(lc_engine, monkeypatch):
    counter = Hold(at=None)                        # counts the tokens chosen after the cancel
    hold_engine_streams(monkeypatch, counter)
    chat = ChatKVBoost(engine=lc_engine, max_tokens=200)
    before = lc_engine.stats()
    received = []
    three = asyncio.Event()

    async def consume():
        async for chunk in chat.astream(STORY):
            received.append(chunk.content)
            if len(received) == 3:
                three.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(three.wait(), 60)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    after = await _wait_for_request_end(lc_engine, before["requests"])
    generated = after["generated_tokens"] - before["generated_tokens"]
    assert after["requests"] == before["requests"] + 1
    assert counter.cancel_event.is_set() and counter.after_cancel <= 1
    assert generated < 200, f"{generated} tokens decoded after {len(received)} were read"


def test_leaving_a_sync_stream_early_closes_the_engine_stream(lc_engine, monkeypatch):
    opened = []
    original = Engine.stream_chat

    def recording_stream_chat(self, messages, **params):
        stream = original(self, messages, **params)
        opened.append(stream)
        return stream

    monkeypatch.setattr(Engine, "stream_chat", recording_stream_chat)
    chat = ChatKVBoost(engine=lc_engine, max_tokens=200)
    stream = chat.stream(STORY)
    read = [next(stream) for _ in range(3)]
    stream.close()
    [engine_stream] = opened
    assert engine_stream._cancel.is_set()          # decoding cannot go on: the run is closed too
    with pytest.raises(StopIteration):
        next(engine_stream)
    assert engine_stream.generation is None and len(read) == 3


async def test_async_timeout_raises_and_stops_decoding(lc_engine, monkeypatch):
    hold = Hold(at=2, timeout=30)                  # still decoding when the 0.05 s timeout fires
    hold_engine_streams(monkeypatch, hold)
    chat = ChatKVBoost(engine=lc_engine, max_tokens=200, timeout=0.05)
    before = lc_engine.stats()
    try:
        with pytest.raises(TimeoutError):
            await chat.ainvoke(STORY)
    finally:
        hold.release.set()
    after = await _wait_for_request_end(lc_engine, before["requests"])
    assert after["generated_tokens"] - before["generated_tokens"] <= 3
    assert hold.after_cancel <= 1
