"""Fault injection into the scheduler: an exception at each step kind reaches the caller it concerns
(type and message kept), the other requests go on, the next request succeeds, no block leaks, and
no wait is unbounded (every request here carries timeout_s, so a hang fails the test instead of
stalling the suite)."""
from __future__ import annotations

import logging
import threading
import time

import pytest
from holds import Hold

from kvboost_engine import BudgetError, Engine, InputError, KVBoostError, RequestTimeoutError
from kvboost_engine.request import decode, scheduler
from kvboost_engine.request.detok import TextAssembler

WAIT = 60          # no request of these tests takes more than a few seconds
ASK = [{"role": "user", "content": "Name a colour."}]
SYSTEM = "You are a terse assistant for a bakery that opens at eight and sells bread and cakes."


def ask(question):
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


class Injected(RuntimeError):
    pass


def raise_once(original, times: int = 1):
    """`original`, except that its first `times` calls raise Injected."""
    calls = {"n": 0}

    def wrapper(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] <= times:
            raise Injected(f"injected fault #{calls['n']}")
        return original(*args, **kwargs)
    wrapper.calls = calls
    return wrapper


def healthy(engine: Engine) -> None:
    """The engine answers the next request; nothing is left running or holding blocks."""
    gen = engine.chat(ASK, max_new_tokens=4, timeout_s=WAIT)
    assert gen.finish_reason in ("stop", "length") and gen.completion_tokens >= 1
    assert engine._scheduler.active == 0
    assert engine.cache.pool.usage()["in_use"] == 0
    engine.cache.check_invariants()
    thread = engine._scheduler._thread
    assert thread is None or thread.is_alive()          # never a dead thread kept in place


@pytest.fixture
def fault_engine(smol):
    engine = Engine(*smol, cache_bytes=64 * 2**20)
    yield engine
    engine.close()


@pytest.mark.parametrize("where, target", [
    ("admission: continues-a-prefill check", (scheduler, "continues_a_prefill")),
    ("admission: assemble", (scheduler, "assemble")),
    ("prefill: settle (prefilled)", (scheduler, "prefilled")),
    ("decode: first token", (decode.Decoding, "begin")),
    ("decode: settle (advance)", (decode.Decoding, "advance")),
    ("forward", (None, "batch")),
])
def test_a_fault_at_each_step_kind_reaches_its_caller_and_the_engine_goes_on(fault_engine, monkeypatch, where, target):
    owner, name = target
    if owner is None:
        owner = fault_engine._parts.prefill.runner
    monkeypatch.setattr(owner, name, raise_once(getattr(owner, name)))
    with pytest.raises(Injected, match="injected fault #1"):
        fault_engine.chat(ASK, max_new_tokens=4, timeout_s=WAIT)
    healthy(fault_engine)


def test_a_fault_hits_only_its_own_request_when_others_share_the_step(fault_engine, monkeypatch):
    baseline = [fault_engine.chat(ask(q), max_new_tokens=8, timeout_s=WAIT).token_ids for q in ("Bread?", "Cakes?")]
    original = decode.Decoding.advance

    def advance(self, logits):
        if "Cakes?" in fault_engine.tokenizer.decode(self.request.prompt.token_ids) and self.valid > self.n + 2:
            raise Injected("this request only")
        return original(self, logits)
    monkeypatch.setattr(decode.Decoding, "advance", advance)
    streams = [fault_engine.stream_chat(ask(q), max_new_tokens=8, timeout_s=WAIT) for q in ("Bread?", "Cakes?")]
    assert streams[0].collect().token_ids == baseline[0]
    with pytest.raises(Injected, match="this request only"):
        streams[1].collect()
    monkeypatch.undo()
    healthy(fault_engine)


def test_a_failing_store_at_the_finish_still_returns_the_reply(fault_engine, monkeypatch, caplog):
    expected = fault_engine.chat(ASK, max_new_tokens=6, timeout_s=WAIT)
    original = decode.store

    def failing_store(parts, prompt, kv, upto, *args, **kwargs):
        if upto > len(prompt):                  # the reply's store at the finish
            raise Injected("disk full")
        return original(parts, prompt, kv, upto, *args, **kwargs)
    monkeypatch.setattr(decode, "store", failing_store)
    with caplog.at_level(logging.WARNING, logger="kvboost_engine.request.decode"):
        gen = fault_engine.chat(ASK, max_new_tokens=6, timeout_s=WAIT)
    assert gen.text == expected.text and gen.finish_reason == expected.finish_reason
    assert "storing KV in the cache failed" in caplog.text and "disk full" in caplog.text
    monkeypatch.undo()
    healthy(fault_engine)


def test_a_failing_store_of_the_prompt_still_answers(fault_engine, monkeypatch):
    monkeypatch.setattr(decode, "store", raise_once(decode.store, times=10))
    assert fault_engine.chat(ASK, max_new_tokens=4, timeout_s=WAIT).completion_tokens >= 1
    monkeypatch.undo()
    healthy(fault_engine)


def test_a_fault_while_cancelling_still_ends_the_stream(fault_engine, monkeypatch):
    hold = Hold(at=3)
    stream = fault_engine.stream_chat(ASK, max_new_tokens=30, constraint=hold, timeout_s=WAIT)
    assert hold.reached.wait(WAIT)
    monkeypatch.setattr(TextAssembler, "finish", raise_once(TextAssembler.finish))
    stream.cancel()
    hold.release.set()
    with pytest.raises(Injected):
        stream.collect()
    monkeypatch.undo()
    healthy(fault_engine)


def test_a_fault_the_loop_cannot_pin_on_one_request_ends_the_admitted_ones_clearly(fault_engine, monkeypatch):
    monkeypatch.setattr(scheduler.Scheduler, "_plan", raise_once(scheduler.Scheduler._plan))
    with pytest.raises(KVBoostError, match="internal error in the engine's scheduler: Injected: injected fault #1"):
        fault_engine.chat(ASK, max_new_tokens=4, timeout_s=WAIT)
    healthy(fault_engine)


def test_a_dead_loop_is_never_kept_and_the_next_request_starts_a_new_one(fault_engine, monkeypatch):
    monkeypatch.setattr(scheduler.Scheduler, "_run", raise_once(scheduler.Scheduler._run))
    with pytest.raises(KVBoostError, match="internal error in the engine's scheduler"):
        fault_engine.chat(ASK, max_new_tokens=4, timeout_s=WAIT)
    deadline = time.monotonic() + WAIT
    while fault_engine._scheduler._thread is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fault_engine._scheduler._thread is None
    healthy(fault_engine)


def test_a_fault_in_a_scheduler_task_reaches_its_caller(fault_engine, monkeypatch):
    monkeypatch.setattr(fault_engine, "_prefill_and_store", raise_once(fault_engine._prefill_and_store))
    with pytest.raises(Injected):
        fault_engine.warm(ASK)
    assert fault_engine.warm(ASK) > 0
    healthy(fault_engine)


# ---- every wait has an end -----------------------------------------------------------------

def test_the_callers_own_timeout_ends_a_wait_and_cancels_the_request(fault_engine):
    hold = Hold(at=2)
    stream = fault_engine.stream_chat(ASK, max_new_tokens=30, constraint=hold, timeout_s=0.5)
    started = time.perf_counter()
    with pytest.raises(RequestTimeoutError, match="timeout_s passed"):
        stream.collect()
    assert time.perf_counter() - started < 5
    hold.release.set()
    healthy(fault_engine)
    assert hold.after_cancel <= 1


@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf"), "5", True])
def test_bad_timeouts_are_refused(fault_engine, value):
    with pytest.raises(InputError, match="timeout_s must be None or a positive number"):
        fault_engine.chat(ASK, max_new_tokens=2, timeout_s=value)


def test_queue_timeout_covers_a_wait_for_a_running_slot(smol):
    engine = Engine(*smol, cache_bytes=0, max_running=1, queue_timeout_s=0.3)
    hold = Hold(at=2)
    first = engine.stream_chat(ASK, max_new_tokens=10, constraint=hold, timeout_s=WAIT)
    assert hold.reached.wait(WAIT)
    started = time.perf_counter()
    second = threading.Thread(target=lambda: results.append(_outcome(engine)))
    results: list = []
    second.start()
    deadline = time.perf_counter() + WAIT
    while not engine._scheduler._waiting and time.perf_counter() < deadline:
        time.sleep(0.01)                     # queued (however slow the thread is to start)
    time.sleep(0.6)
    hold.release.set()                       # the slot frees only now, after the queue timeout
    second.join(WAIT)
    assert isinstance(results[0], BudgetError), results
    assert "every running slot stayed busy (max_running=1)" in str(results[0]) and "waited" in str(results[0])
    assert time.perf_counter() - started < WAIT
    assert first.collect().completion_tokens == 10
    healthy(engine)
    engine.close()


def _outcome(engine):
    try:
        return engine.chat(ASK, max_new_tokens=4, timeout_s=WAIT)
    except Exception as err:  # noqa: BLE001
        return err


def test_max_waiting_zero_still_runs_a_request_on_an_idle_engine(smol):
    engine = Engine(*smol, cache_bytes=0, max_waiting=0)
    assert engine.chat(ASK, max_new_tokens=3, timeout_s=WAIT).completion_tokens >= 1
    engine.close()


def test_max_waiting_zero_refuses_beyond_the_free_slots(smol):
    engine = Engine(*smol, cache_bytes=0, max_waiting=0, max_running=1)
    hold = Hold(at=2)
    first = engine.stream_chat(ASK, max_new_tokens=5, constraint=hold, timeout_s=WAIT)
    assert hold.reached.wait(WAIT)
    with pytest.raises(BudgetError, match="max_waiting=0"):
        engine.chat(ASK, max_new_tokens=3, timeout_s=WAIT)
    hold.release.set()
    first.collect()
    engine.close()


def test_prefill_chunks_smaller_than_max_running_still_progress(smol):
    engine = Engine(*smol, cache_bytes=0, prefill_chunk_tokens=4, max_running=8)
    assert engine._scheduler.max_batch_tokens == 8
    results = [None] * 8

    def work(i):
        results[i] = engine.chat(ask(f"Question {i}?"), max_new_tokens=6, timeout_s=WAIT)
    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert all(r is not None and r.completion_tokens >= 1 for r in results)
    engine.close()


# ---- the reply memo after a stop string is linear --------------------------------------------

def test_reply_ids_after_a_stop_string_take_a_few_decodes(smol):
    _, tokenizer = smol
    ids = tokenizer.encode("one two three " * 200 + "STOP and more", add_special_tokens=False)
    calls = {"n": 0}

    class Counting:
        def decode(self, *args, **kwargs):
            calls["n"] += 1
            return tokenizer.decode(*args, **kwargs)
    text = TextAssembler(Counting(), (" STOP",))
    for token in ids:
        text.add(token)
    assert text.stopped_at is not None
    calls["n"] = 0
    found = text.ids_for(text.final_text)
    assert found is not None and tokenizer.decode(found) == text.final_text
    assert calls["n"] <= 3
