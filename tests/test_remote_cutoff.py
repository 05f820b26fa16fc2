"""The remote backend's bounds on one request: the classes' `timeout` bounds the whole request
(a server that keeps sending no text, SSE comments, several hanging replicas), a cancel or the
engine's close() wakes a read blocked in another thread at once, the server's /metrics counters
are credited to a request only when it ran alone, and an async client per `asyncio.run` leaves
no error in the log."""
from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

pytest.importorskip("openai")
pytest.importorskip("langchain_core")
pytest.importorskip("llama_index.core")

from fake_openai_server import Fault, FakeServer  # noqa: E402
from llama_index.core.base.llms.types import ChatMessage  # noqa: E402

from kvboost_engine import RequestTimeoutError  # noqa: E402
from kvboost_integrations.langchain import ChatKVBoost, KVBoostLLM  # noqa: E402
from kvboost_integrations.llama_index import KVBoost  # noqa: E402
from kvboost_integrations.remote import EngineClosedError, RemoteEngine  # noqa: E402

TIMEOUT_S = 1.0
SLACK_S = 1.5           # sleeping, not computing, so a loaded machine adds little (the old code: forever)
HI = [{"role": "user", "content": "Hi"}]


def _ask(kind: str, url):
    options = dict(endpoint=url, served_model="fake-model", timeout=TIMEOUT_S)
    if kind == "chat":
        return lambda: ChatKVBoost(**options, max_tokens=32).invoke("Hi")
    if kind == "text":
        return lambda: KVBoostLLM(**options, max_tokens=32).invoke("Hi")
    return lambda: KVBoost(**options, max_new_tokens=32).chat([ChatMessage(role="user", content="Hi")])


@pytest.mark.parametrize("kind", ["chat", "text", "llama_index"])
@pytest.mark.parametrize("after_chunks", [0, 2])
def test_timeout_bounds_a_request_whose_server_sends_no_text(kind, after_chunks):
    """SSE comments every 0.1 s and no chunk: no read ever timed out, so a sync call ran forever
    (async calls stopped at the timeout)."""
    with FakeServer(fault=Fault("keepalive", after_chunks=after_chunks, delay_s=0.1)) as server:
        ask = _ask(kind, server.url)
        started = time.perf_counter()
        with pytest.raises(RequestTimeoutError, match=r"timeout of 1 s"):
            ask()
        assert time.perf_counter() - started < TIMEOUT_S + SLACK_S


def test_timeout_bounds_the_whole_request_over_every_replica():
    """Three hanging replicas took three timeouts (each attempt got the whole of it)."""
    with FakeServer(fault=Fault("hang")) as a, FakeServer(fault=Fault("hang")) as b, \
            FakeServer(fault=Fault("hang")) as c:
        llm = ChatKVBoost(endpoint=[a.url, b.url, c.url], served_model="fake-model", timeout=TIMEOUT_S, max_tokens=8)
        started = time.perf_counter()
        with pytest.raises(TimeoutError):
            llm.invoke("Hi")
        assert time.perf_counter() - started < TIMEOUT_S + SLACK_S


def test_timeout_bounds_a_reply_that_never_starts_with_openais_retries():
    """Before a response's headers the deadline could not cut: each attempt, and each of openai's own
    retries (max_retries), waited the whole read timeout (5 s at timeout=1, max_retries=2); the async
    path raised ReplicaUnavailableError where the sync one raised a timeout."""
    with FakeServer(fault=Fault("hang")) as server:
        engine = RemoteEngine(server.url, served_model="fake-model", timeout=TIMEOUT_S, max_retries=2)

        async def ask():
            return [item async for item in engine.astream_chat(HI)]
        for run in (lambda: engine.chat(HI), lambda: asyncio.run(ask())):
            started = time.perf_counter()
            with pytest.raises(RequestTimeoutError):
                run()
            assert time.perf_counter() - started < TIMEOUT_S + SLACK_S
        engine.close()


def test_a_reply_that_ends_in_time_is_kept_and_the_timer_is_gone():
    with FakeServer(chunk_delay_s=0.01) as server:
        engine = RemoteEngine(server.url, served_model="fake-model", timeout=5)
        before = threading.active_count()
        assert engine.chat(HI).text == server.reply
        time.sleep(0.1)
        assert threading.active_count() <= before          # the deadline's timer was cancelled
        engine.close()


def _read_in_thread(stream) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def read():
        try:
            out["text"] = "".join(stream)
            out["generation"] = stream.generation
        except BaseException as err:  # noqa: BLE001 - the test looks at it
            out["error"] = err
    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread, out


def _stalled_read(server, stop) -> tuple[str, dict]:
    """Two chunks of a reply, then the rest read in another thread from a server that stalls;
    `stop(engine, stream)` from here must end that read at once. The first delta, and what the read saw."""
    engine = RemoteEngine(server.url, served_model="fake-model", read_timeout_s=30)
    stream = engine.stream_chat(HI)
    first = next(stream)
    thread, out = _read_in_thread(stream)
    time.sleep(0.3)
    started = time.perf_counter()
    stop(engine, stream)
    thread.join(10)
    assert not thread.is_alive() and time.perf_counter() - started < SLACK_S
    out["engine"] = engine
    return first, out


def test_a_cancel_wakes_a_read_blocked_on_a_stalled_server():
    """A cancel was seen only when the next chunk came: against a stalled server, after
    read_timeout_s (then the replica was marked down, though the user had cancelled)."""
    with FakeServer(fault=Fault("hang", after_chunks=2)) as server:
        first, out = _stalled_read(server, lambda engine, stream: stream.cancel())
        engine = out["engine"]
        assert "error" not in out and out["generation"].finish_reason == "cancelled"
        assert first + out["text"] == out["generation"].text
        assert not engine.router.state()[server.url]["down"]
        engine.close()


def test_close_wakes_a_read_blocked_on_a_stalled_server():
    """close() returned at once but the reader stayed blocked until read_timeout_s (22 s measured)."""
    with FakeServer(fault=Fault("hang", after_chunks=2)) as server:
        _, out = _stalled_read(server, lambda engine, stream: engine.close())
        assert isinstance(out.get("error"), EngineClosedError)


def test_metrics_counters_are_credited_only_to_a_request_that_ran_alone():
    """Without cached tokens in its usage, a request took the /metrics counters' difference as its
    own: one that overlapped another was credited with the other's cached tokens (100 % cached
    for a brand-new prompt)."""
    system = {"role": "system", "content": "You are helpful. " * 100}
    with FakeServer(report_cached=False, reply=" ".join(["w"] * 10), chunk_delay_s=0.05) as server:
        engine = RemoteEngine(server.url, served_model="fake-model")
        engine.chat([system, {"role": "user", "content": "warm"}], max_new_tokens=4)
        alone = engine.chat([system, {"role": "user", "content": "again"}], max_new_tokens=4)
        assert alone.server["source"] == "metrics" and alone.server["cached_tokens"] > 0
        out = {}
        new = threading.Thread(target=lambda: out.setdefault("new", engine.chat(
            [{"role": "user", "content": "zebra quantum"}], max_new_tokens=10)))
        new.start()
        time.sleep(0.05)
        out["shared"] = engine.chat([system, {"role": "user", "content": "question"}], max_new_tokens=10)
        new.join()
        for gen in out.values():
            assert gen.server["cached_tokens"] is None and gen.reused_tokens == 0
        engine.close()


def test_an_async_request_per_event_loop_logs_no_error(caplog):
    """The async client of a loop that had ended closed itself on the next loop: 'Task exception
    was never retrieved ... Event loop is closed' logged for most requests."""
    with FakeServer() as server:
        engine = RemoteEngine(server.url, served_model="fake-model")

        async def ask():
            return [item async for item in engine.astream_chat(HI, max_new_tokens=32)][-1].text
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            for _ in range(8):
                assert asyncio.run(ask()) == server.reply
        engine.close()
    assert not [r for r in caplog.records if r.name == "asyncio"]
