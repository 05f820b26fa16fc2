"""Instrumentation, memory accounting, request counters however a request ends, and close()."""
import pytest
from transformers import AutoTokenizer

from kvboost_engine import Engine, FirstTokenEvent, ForwardEvent, KVBoostError
from kvboost_engine.loading import default_model_dir
from holds import Hold
from tiny_models import tiny_model


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", max_position_embeddings=1024), AutoTokenizer.from_pretrained(default_model_dir())


def test_instrumentation_reports_each_forward_and_the_first_logits(tiny):
    engine = Engine(*tiny, prefill_chunk_tokens=64)
    prompt = "one two three " * 40                                  # > 64 tokens: several prefill pieces
    events = []
    with engine.instruments.subscribe(events.append):
        gen = engine.generate(prompt, max_new_tokens=5, min_new_tokens=5)
    prefill = [e for e in events if isinstance(e, ForwardEvent) and e.kind == "prefill"]
    decode = [e for e in events if isinstance(e, ForwardEvent) and e.kind == "decode"]
    assert sum(e.tokens for e in prefill) == gen.prompt_tokens and len(prefill) == -(-gen.prompt_tokens // 64)
    assert [e.start for e in decode] == list(range(gen.prompt_tokens, gen.prompt_tokens + 4))
    assert all(e.seconds > 0 for e in prefill + decode)
    first = [e for e in events if isinstance(e, FirstTokenEvent)]
    assert len(first) == 1 and int(first[0].logits.argmax()) == gen.token_ids[0]
    events.clear()
    engine.generate(prompt, max_new_tokens=2)                       # unsubscribed: nothing recorded
    assert events == []


def test_a_failing_observer_does_not_break_requests(tiny):
    engine = Engine(*tiny)

    def broken(event):
        raise RuntimeError("observer bug")

    with engine.instruments.subscribe(broken):
        assert engine.generate("Hello", max_new_tokens=3, min_new_tokens=3).completion_tokens == 3


def test_stats_count_every_request_however_it_ends(tiny):
    engine = Engine(*tiny)
    engine.generate("Hello there", max_new_tokens=3, min_new_tokens=3)
    stream = engine.stream("Hello again, and again", max_new_tokens=20, min_new_tokens=20)
    next(stream)
    stream.close()                                                 # closed early by the consumer
    cancelled = engine.stream("A third one", max_new_tokens=20, min_new_tokens=20)
    cancelled.cancel()
    cancelled.collect()
    stats = engine.stats()
    assert stats["requests"] == 3
    assert stats["generated_tokens"] >= 3 + 1             # the cancelled one may stop before its first token
    assert stats["prompt_tokens"] == sum(engine.count_tokens(p) for p in
                                         ("Hello there", "Hello again, and again", "A third one"))


def test_memory_accounts_for_cached_and_running_kv(tiny):
    engine = Engine(*tiny, cache_bytes=2**22)
    idle = engine.memory()
    assert idle["cached_bytes"] == idle["in_use_bytes"] == 0 and idle["free_bytes"] == idle["pool_bytes"]
    hold = Hold(at=2)
    stream = engine.stream("Count: " + "one two " * 30, max_new_tokens=4, min_new_tokens=4, constraint=hold)
    try:
        assert hold.reached.wait(60)
        busy = engine.memory()                                          # the request cannot have ended yet
    finally:
        hold.release.set()
    assert busy["in_use_bytes"] > 0 and busy["cached_bytes"] > 0       # the prompt is stored at first token
    stream.collect()
    done = engine.memory()
    assert done["in_use_bytes"] == 0 and done["cached_bytes"] == engine.stats()["bytes_used"]
    assert done["cached_bytes"] + done["free_bytes"] == done["pool_bytes"] == done["only_cached_bytes"] + done["free_bytes"]


def test_close_flushes_and_refuses_later_requests(tiny, tmp_path):
    messages = [{"role": "system", "content": "You keep notes. " * 8}, {"role": "user", "content": "Note this."}]
    engine = Engine(*tiny, disk_cache_dir=str(tmp_path))
    engine.chat(messages, max_new_tokens=2)
    engine.close()
    assert engine.disk.stats()["pending_writes"] == 0 and list(tmp_path.rglob("*.kv"))
    engine.close()                                                  # twice is fine
    with pytest.raises(KVBoostError, match="closed"):
        engine.generate("again", max_new_tokens=2)
    with Engine(*tiny, disk_cache_dir=str(tmp_path)) as reopened:   # a restart finds what was written
        again = reopened.chat(messages, max_new_tokens=2)
        assert again.reused_tokens > 0 and reopened.stats()["disk_restored_chunks"] > 0


EXIT_SCRIPT = """
import gc, torch
from kvboost_engine import Engine
from kvboost_engine.loading import default_model_dir, load_model_and_tokenizer
model, tok = load_model_and_tokenizer(default_model_dir(), device=torch.device("cpu"), dtype=torch.float32)
for _ in range(3):
    engine = Engine(model, tok)
    engine.chat([{"role": "user", "content": "Say hi."}], max_new_tokens=4)
    del engine
    gc.collect()
"""


def test_engines_dropped_right_after_a_reply_let_the_interpreter_exit_cleanly(smol):
    """An engine dropped while its scheduler thread is still ending (the thread then frees it) must not
    be freed during interpreter finalization: that aborted the process (exit 134, "terminate called
    without an active exception") in about 1 of 3 runs before the exit hook waited for those threads."""
    import subprocess
    import sys
    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and "terminate called" not in done.stderr, done.stderr[-500:]
