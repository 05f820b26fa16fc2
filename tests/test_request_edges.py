"""Edges of a request's life a careful caller meets: a scheduler thread that cannot start, a stream
dropped or interrupted unfinished, the logprobs of held-back text, a reply whose special tokens the
text dropped, a temperature too small to divide by, and every token masked while sampling."""
from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

from kvboost_engine import Engine, InputError
from kvboost_engine.request.sampling import Sampler, SamplingParams

ASK = [{"role": "user", "content": "Say hello in one short sentence."}]


def _wait_idle(engine: Engine, timeout_s: float = 10.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if engine._scheduler.active == 0:
            return True
        time.sleep(0.01)
    return False


def test_a_scheduler_thread_that_cannot_start_fails_only_that_call(smol, monkeypatch):
    engine = Engine(*smol, cache_bytes=0)
    real_start = threading.Thread.start

    def refuse(thread):
        if thread.name == "kvboost-scheduler":
            raise RuntimeError("can't start new thread")
        return real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", refuse)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        engine.chat(ASK, max_new_tokens=2)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        engine.next_token_logits("Hello")                    # a task on the loop: refused the same way
    assert not engine._scheduler._waiting and not engine._scheduler._tasks
    monkeypatch.setattr(threading.Thread, "start", real_start)
    assert engine.chat(ASK, max_new_tokens=2, timeout_s=30).completion_tokens == 2    # the next call starts it
    stray = threading.Thread(target=engine._scheduler._loop)    # started but never recorded (an interrupted
    stray.start()                                                # start()): it ends at once, not a second loop
    stray.join(5)
    assert not stray.is_alive()
    engine.close()                                           # and close() joins a thread that ran


def test_a_stream_dropped_or_interrupted_unfinished_stops_its_request(smol):
    engine = Engine(*smol, cache_bytes=0)
    stream = engine.stream_chat(ASK, max_new_tokens=2000, min_new_tokens=2000)
    next(stream)
    del stream
    gc.collect()
    assert _wait_idle(engine, 2.0), "the dropped stream kept decoding"

    stream = engine.stream_chat(ASK, max_new_tokens=2000, min_new_tokens=2000)
    run = stream._run

    def interrupted():
        yield next(run)
        raise KeyboardInterrupt

    stream._run = interrupted()
    next(stream)
    with pytest.raises(KeyboardInterrupt):
        next(stream)
    assert _wait_idle(engine, 2.0), "an interrupted stream kept decoding"
    engine.close()


def test_streamed_deltas_carry_the_logprobs_of_held_back_text(smol):
    engine = Engine(*smol, cache_bytes=0)
    # text that could start a stop string is held back, then sent when the reply ends
    stream = engine.stream_chat(ASK, max_new_tokens=40, logprobs=True, stop=[".QQQ", "!QQQ"])
    entries = []
    for delta in stream:
        entries += getattr(delta, "logprobs", None) or []
    gen = stream.generation
    assert gen.text.endswith((".", "!")) and gen.logprobs
    assert entries == gen.logprobs
    engine.close()


class _ForceFirst:
    """A LogitsConstraint whose reply starts with one given token, then anything."""

    def __init__(self, token: int):
        self.token, self.n = token, 0

    def mask(self, logits):
        if self.n == 0:
            keep = logits[self.token].clone()
            logits[:] = float("-inf")
            logits[self.token] = keep
        return logits

    def advance(self, token):
        self.n += 1

    def is_finished(self):
        return False


def test_a_reply_whose_text_dropped_special_tokens_is_not_remembered_with_them(smol):
    model, tokenizer = smol
    special = tokenizer.convert_tokens_to_ids("<|im_start|>")
    engine = Engine(model, tokenizer, cache_bytes=64 * 2**20)
    reply = engine.chat(ASK, constraint=_ForceFirst(special), max_new_tokens=6)
    assert reply.token_ids[0] == special and "<|im_start|>" not in reply.text
    turn = ASK + [{"role": "assistant", "content": reply.text}, {"role": "user", "content": "Again."}]
    fresh = Engine(model, tokenizer, cache_bytes=0)
    assert engine.encode_messages(turn).token_ids == fresh.encode_messages(turn).token_ids
    engine.close()
    fresh.close()


def test_a_tiny_temperature_is_its_greedy_limit_and_a_fully_masked_draw_is_an_input_error():
    """(With every logit negative, a tiny temperature scaled them all to -inf: an InputError.)"""
    logits = torch.tensor([0.5, 3.0, 1.0, 2.9])
    tiny = Sampler(SamplingParams.build(temperature=1e-40, seed=1), torch.device("cpu"))
    assert tiny.pick(logits) == 1
    assert tiny.pick(logits - 50) == 1          # every logit negative (a logit_bias): was "every logit is -inf"
    masked = Sampler(SamplingParams.build(temperature=0.7, seed=1), torch.device("cpu"))
    with pytest.raises(InputError, match="every logit is -inf"):
        masked.pick(torch.full((4,), float("-inf")))
