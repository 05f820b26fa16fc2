"""Threads meeting inside one engine: observers calling back, admission between prefill and decode,
close() from two threads, the disk writer's thread, exit order. Each interleaving is forced (an
observer or a patched function holds one side), never left to timing."""
from __future__ import annotations

import threading
import time
import weakref

import pytest
import torch
from transformers import AutoTokenizer

from kvboost_engine import Engine, FirstTokenEvent, ForwardEvent, InputError, KVBoostError, QueueFullError
from kvboost_engine.instrument import Instruments
from kvboost_engine.kv.disk import DiskTier
from kvboost_engine.loading import default_model_dir
from kvboost_engine.request import exit as request_exit
from tiny_models import tiny_model

FP, KEY = b"f" * 16, b"k" * 16
KV = torch.zeros(2, 1, 1, 2, 4)


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", max_position_embeddings=1024), AutoTokenizer.from_pretrained(default_model_dir())


def _finishes(fn, seconds: float = 60) -> bool:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive()


def test_an_observer_may_run_a_forward_of_its_own(tiny):
    """ForwardEvent was emitted under the runner's lock: an observer asking next_token_logits (which
    Scheduler.call runs inline on the scheduler thread) waited on that lock for good."""
    engine = Engine(*tiny)
    asked = []

    def observer(event):
        if isinstance(event, ForwardEvent) and not asked:
            asked.append(None)                   # its own forward emits an event too
            asked[0] = engine.next_token_logits("a side question")

    with engine.instruments.subscribe(observer):
        assert _finishes(lambda: engine.generate("Hello there", max_new_tokens=3))
    assert len(asked) == 1 and asked[0].shape[-1] > 0
    assert _finishes(engine.close)


def test_a_request_from_an_observer_is_refused_not_a_deadlock(tiny):
    engine = Engine(*tiny)
    errors = []

    def observer(event):
        if isinstance(event, FirstTokenEvent) and not errors:
            try:
                engine.generate("from inside", max_new_tokens=1)
            except InputError as error:
                errors.append(error)

    with engine.instruments.subscribe(observer):
        assert _finishes(lambda: engine.generate("Hello there", max_new_tokens=3))
    assert len(errors) == 1 and "callback" in str(errors[0])
    engine.close()


def test_a_request_starting_to_decode_holds_its_running_slot(tiny):
    """Between the end of its prefill and its first decode step a request was in neither list: with
    max_running=1 and max_waiting=0 another request was queued instead of refused."""
    engine = Engine(*tiny, max_running=1, max_waiting=0)
    _refused_while_the_first_begins(engine, lambda: engine.generate("one two three", max_new_tokens=4,
                                                                    min_new_tokens=4))
    engine.close()


def _refused_while_the_first_begins(engine, first_request) -> None:
    """Hold `first_request` at its first token (an observer) and check that the engine counts it as
    running: with max_running=1 and max_waiting=0 another request is refused at once."""
    in_begin, release = threading.Event(), threading.Event()

    def observer(event):
        if isinstance(event, FirstTokenEvent) and not in_begin.is_set():
            in_begin.set()
            release.wait(30)

    subscription = engine.instruments.subscribe(observer)
    first = threading.Thread(target=first_request)
    first.start()
    assert in_begin.wait(60)
    try:
        assert engine._scheduler.active == 1
        with pytest.raises(QueueFullError):
            engine.stream("another request", max_new_tokens=1)
    finally:
        release.set()
        first.join(60)
        subscription.close()


def test_a_moved_request_starting_to_decode_holds_its_running_slot(tiny):
    from test_moved_reuse import as_parts
    engine = Engine(*tiny, moved_reuse="blend", max_running=1, max_waiting=0)
    engine.chat(as_parts(range(6), "Summarise."), max_new_tokens=1)
    got = []
    _refused_while_the_first_begins(engine, lambda: got.append(engine.chat(as_parts([4, 0, 2], "What?"),
                                                                           max_new_tokens=2)))
    assert got and got[0].reused_moved > 0
    engine.close()


def test_a_moved_request_ended_at_once_has_left_its_slot_when_its_reply_arrives(tiny, monkeypatch):
    """A moved request finished inside its first step (one token) handed its reply over before its
    slot was counted free: the caller's next request was refused (max_running=1, max_waiting=0)."""
    from kvboost_engine.request.scheduler import Scheduler
    from test_moved_reuse import as_parts
    engine = Engine(*tiny, moved_reuse="blend", max_running=1, max_waiting=0)
    engine.chat(as_parts(range(6), "Summarise."), max_new_tokens=1)
    real = Scheduler._decode

    def slow_decode(self, request, done):            # the scheduler thread paused right after
        real(self, request, done)
        time.sleep(0.3)

    monkeypatch.setattr(Scheduler, "_decode", slow_decode)
    assert engine.chat(as_parts([4, 0, 2], "What?"), max_new_tokens=1).reused_moved > 0
    engine.generate("another request", max_new_tokens=1)    # its slot is free: not refused
    engine.close()


def test_an_observer_closing_the_engine_during_a_close_does_not_deadlock(tiny):
    """close() held a lock while it waited for the scheduler thread; an observer on that thread
    calling close() (a watchdog) waited for the lock: both waited for good."""
    engine = Engine(*tiny)
    step, ended = threading.Event(), []

    def observer(event):
        if isinstance(event, ForwardEvent) and not step.is_set():
            step.set()
            while not engine._closed:                # another thread's close() has begun
                time.sleep(0.01)
            engine.close()

    engine.instruments.subscribe(observer)

    def request():
        try:
            list(engine.stream("Hello there", max_new_tokens=20))
        except KVBoostError as error:                # the close ends it
            ended.append(error)

    requester = threading.Thread(target=request, daemon=True)
    requester.start()
    assert step.wait(60)
    assert _finishes(engine.close, 30)
    requester.join(30)
    assert len(ended) == 1 and "closed" in str(ended[0])


def test_what_an_observers_close_could_not_free_goes_with_a_later_close(tiny):
    """close() from an observer (on the scheduler thread, inside a step) cannot free the KV pool or the
    native step's memory; a later close() from another thread did not either (it only waited)."""
    engine = Engine(*tiny)
    closed = threading.Event()

    def observer(event):
        if isinstance(event, ForwardEvent) and not closed.is_set():
            engine.close()
            closed.set()

    engine.instruments.subscribe(observer)
    with pytest.raises(KVBoostError):
        engine.generate("Hello there", max_new_tokens=20)
    assert closed.wait(30) and engine.cache.pool.ram.numel() > 0          # still held: its step was running
    assert _finishes(engine.close, 30)
    assert engine.cache.pool.ram.numel() == 0 and engine.memory()["pool_bytes"] == 0
    assert engine._native is None or engine._native._handle is None


def test_a_second_close_returns_after_the_writes_are_flushed(tiny, tmp_path, monkeypatch):
    import kvboost_engine.kv.disk.tier as tier_module
    engine = Engine(*tiny, disk_cache_dir=str(tmp_path))
    gate, real = threading.Event(), tier_module.write_entry
    monkeypatch.setattr(tier_module, "write_entry", lambda *a: (gate.wait(30), real(*a))[1])
    engine.generate("Hello there, a prompt to cache " * 4, max_new_tokens=2)
    first = threading.Thread(target=engine.close)
    first.start()
    while engine.disk.stats()["pending_writes"] and not engine._closed:
        time.sleep(0.01)
    second = threading.Thread(target=engine.close)
    second.start()
    second.join(0.5)
    assert second.is_alive()                      # waits for the first close
    gate.set()
    first.join(30)
    second.join(30)
    assert not second.is_alive() and engine.disk.stats()["pending_writes"] == 0


def test_a_writer_thread_that_cannot_start_leaves_nothing_queued(tmp_path, monkeypatch):
    """The thread was recorded before start(): when start() failed, every later write queued for a
    thread that never ran, flush() never succeeded and close() never returned. Now the write happens on
    the caller's thread (Python 3.12 refuses new threads at interpreter exit, when the last steps store)."""
    tier = DiskTier(tmp_path, 1 << 20, FP, fsync=False)
    real = threading.Thread.start

    def fails_once(self):
        monkeypatch.setattr(threading.Thread, "start", real)
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threading.Thread, "start", fails_once)
    assert tier.put_async(KEY, 0, (1, 2), KV, True)
    assert tier.stats()["pending_writes"] == 0 and tier.stats()["pending_bytes"] == 0
    assert tier.get(KEY) is not None and tier._writer._thread is None
    assert tier.put_async(b"j" * 16, 0, (3, 4), KV, True) and tier.flush(timeout=10)
    assert _finishes(tier.close, 10) and tier.get(b"j" * 16) is not None


def test_an_idle_writer_thread_ends_and_a_dropped_engine_leaves_none(tiny, tmp_path, monkeypatch):
    """The writer waited for close() for good: an engine dropped without close() left its thread and,
    through it, its disk tier alive (one thread per engine a web app made per request)."""
    from kvboost_engine.kv.disk.writer import WriteBehind
    monkeypatch.setattr(WriteBehind, "IDLE_EXIT_S", 0.05)
    writers = lambda: [t for t in threading.enumerate() if t.name == "kvboost-disk-writer"]  # noqa: E731
    before = len(writers())
    tiers = []
    for i in range(3):
        engine = Engine(*tiny, disk_cache_dir=str(tmp_path))
        engine.generate(f"A prompt of its own, number {i} " * 4, max_new_tokens=2)
        tiers.append(weakref.ref(engine.disk))
        del engine
    deadline = time.monotonic() + 30
    while (len(writers()) > before or any(t() is not None for t in tiers)) and time.monotonic() < deadline:
        __import__("gc").collect()
        time.sleep(0.05)
    assert len(writers()) == before and all(t() is None for t in tiers)
    tier = DiskTier(tmp_path / "again", 1 << 20, FP, fsync=False)       # a writer that ended starts again
    for key in (KEY, b"j" * 16):
        assert tier.put_async(key, 0, (1, 2), KV, True) and tier.flush(timeout=10)
        deadline = time.monotonic() + 10
        while tier._writer._thread is not None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert tier._writer._thread is None and tier.get(key) is not None
    assert _finishes(tier.close, 10)


def test_a_failed_replacing_write_keeps_the_old_file_counted(tmp_path, monkeypatch):
    import kvboost_engine.kv.disk.tier as tier_module
    tier = DiskTier(tmp_path, 1 << 20, FP, fsync=False)
    assert tier.put(KEY, 0, (1, 2), KV, False)

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tier_module, "write_entry", full_disk)
    assert not tier.put(KEY, 0, (1, 2), KV, True)
    on_disk = sum(p.stat().st_size for p in tier.root.rglob("*.kv"))
    assert tier.stats()["entries"] == 1 and tier.stats()["bytes_used"] == on_disk > 0
    assert tier.get(KEY)[3] is False


def test_an_exact_write_replaces_a_queued_inexact_one(tmp_path, monkeypatch):
    """The writer skipped a key already on its way, so an exact entry queued behind another
    engine's inexact one of the same key was dropped and the inexact file stayed."""
    import kvboost_engine.kv.disk.tier as tier_module
    tier = DiskTier(tmp_path, 1 << 20, FP, fsync=False)
    gate, real = threading.Event(), tier_module.write_entry
    monkeypatch.setattr(tier_module, "write_entry", lambda *a: (gate.wait(30), real(*a))[1])
    assert tier.put_async(KEY, 0, (1, 2), torch.ones(2, 1, 1, 2, 4), False)      # being written (held)
    assert tier.put_async(b"q" * 16, 0, (1, 2), KV, False)                        # queued behind it
    assert tier.put_async(b"q" * 16, 0, (1, 2), KV, True)                         # takes its place
    assert tier.put_async(KEY, 0, (1, 2), KV, True)                               # follows the write
    assert tier.put_async(KEY, 0, (1, 2), torch.ones(2, 1, 1, 2, 4), False)      # an inexact one: no effect
    gate.set()
    assert tier.flush(timeout=30)
    assert tier.get(KEY)[3] is True and torch.equal(tier.get(KEY)[2], KV)
    assert tier.get(b"q" * 16)[3] is True
    assert tier.stats()["pending_bytes"] == 0
    tier.close()


def test_no_event_reaches_a_subscription_after_it_closed():
    instruments, late = Instruments(), []

    def first(event):                            # another thread leaves its `with subscribe(...)` now
        thread = threading.Thread(target=second.close)
        thread.start()
        thread.join()

    instruments.subscribe(first)
    second = instruments.subscribe(late.append)
    instruments.emit("event")
    assert late == []
    assert not instruments.active or len(instruments._subscriptions) == 1


def test_at_exit_the_disk_is_flushed_after_the_schedulers_stop(monkeypatch):
    """The flush ran before the schedulers were stopped: the chunks their last steps stored were lost."""
    order = []

    class Fake:
        def __init__(self, name):
            self.name = name

        def close(self):
            order.append(f"{self.name} closed")

        def flush(self, timeout=None):
            order.append(f"{self.name} flushed")

    scheduler, tier = Fake("scheduler"), Fake("tier")
    monkeypatch.setattr(request_exit, "live_schedulers", weakref.WeakSet([scheduler]))
    monkeypatch.setattr(request_exit, "scheduler_threads", weakref.WeakSet())
    monkeypatch.setattr(request_exit, "flushed_at_exit", weakref.WeakSet([tier]))
    request_exit._close_all()
    assert order == ["scheduler closed", "tier flushed"]
