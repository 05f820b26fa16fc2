"""Bad input: a clear error naming the limit, and the engine stays usable."""
import numpy
import pytest
import torch

from kvboost_engine import (BudgetError, ContextWindowError, Engine, EngineConfig, InputError, ModelNotFoundError,
                            UnsupportedModelError)

OK = [{"role": "user", "content": "Say hi."}]


@pytest.mark.parametrize("call, match", [
    (lambda e: e.chat([]), "messages is empty"),
    (lambda e: e.generate(""), "prompt is empty"),
    (lambda e: e.chat([{"role": "robot", "content": "x"}]), "unknown role 'robot'"),
    (lambda e: e.chat([{"role": "user", "content": None}]), "content must be a string"),
    (lambda e: e.chat([{"role": "user", "content": b"bytes"}]), "content must be a string"),
    (lambda e: e.chat(OK, max_new_tokens=0), "max_new_tokens must be an int >= 1"),
    (lambda e: e.chat(OK, max_new_tokens=2.5), "max_new_tokens must be an int >= 1"),
    (lambda e: e.chat(OK, temperature=-0.1), "temperature must be a finite number >= 0"),
    (lambda e: e.chat(OK, top_p=0), r"top_p must be in \(0, 1\]"),
    (lambda e: e.chat(OK, top_k=-1), "top_k must be an int >= 0"),
    (lambda e: e.chat(OK, max_tokens=5), r"unknown request parameters \['max_tokens'\] \(max_new_tokens is"),
    (lambda e: e.chat(OK, stop=[3]), "stop must be a string or a list of strings"),
    (lambda e: e.chat(OK, stop=5), "stop must be a string or a list of strings"),
    (lambda e: e.chat(OK, temperature=float("nan")), "temperature must be a finite number >= 0"),
    (lambda e: e.chat(OK, temperature=float("inf")), "temperature must be a finite number >= 0"),
    (lambda e: e.chat(OK, top_p=float("nan")), r"top_p must be in \(0, 1\]"),
    (lambda e: e.chat(OK, seed=2**70), r"seed must be None or an int in \[0, 2\*\*64\)"),
    (lambda e: e.chat([{"role": "user", "content": "a\ud800b"}]),
     r"message 0 \(role 'user'\) is not valid Unicode: lone surrogate '\\ud800' at character 1"),
    (lambda e: e.chat([OK[0], {"role": "assistant", "content": [{"type": "text", "text": "\udfff"}]}]),
     r"message 1 \(role 'assistant'\) is not valid Unicode"),
    (lambda e: e.generate(["fine", "bad \ud800"]), r"prompt segment 1 is not valid Unicode"),
    (lambda e: e.count_tokens("\ud800"), r"prompt segment 0 is not valid Unicode"),
    (lambda e: e.chat(OK, max_new_tokens=9000), "context window of 8192 tokens"),
    (lambda e: e.generate("word " * 8190, max_new_tokens=8), "context window of 8192 tokens"),
])
def test_bad_requests_raise_clear_errors_and_engine_stays_usable(engine, call, match):
    with pytest.raises(InputError, match=match):
        call(engine)
    assert engine.chat(OK, max_new_tokens=3).completion_tokens >= 1


def test_context_window_error_is_specific(engine):
    with pytest.raises(ContextWindowError, match="prompt has .* tokens and max_new_tokens is 9000"):
        engine.chat(OK, max_new_tokens=9000)


def test_bad_engine_options():
    with pytest.raises(InputError, match="cache_bytes"):
        Engine.from_pretrained(cache_bytes=-1)
    with pytest.raises(InputError, match="chunk_tokens"):
        Engine.from_pretrained(chunk_tokens=0)
    with pytest.raises(InputError, match="dtype must be one of"):
        Engine.from_pretrained(dtype="float8")
    with pytest.raises(InputError, match="kv_pool_bytes must be None or an int >= 0, got 1.5"):
        Engine.from_pretrained(kv_pool_bytes=1.5)          # refused before the weights load


@pytest.mark.parametrize("options, match", [
    ({"kv_pool_bytes": 1.5}, "kv_pool_bytes must be None or an int >= 0, got 1.5"),
    ({"kv_pool_bytes": "10"}, "kv_pool_bytes must be None or an int >= 0, got '10'"),
    ({"kv_pool_bytes": -1}, "kv_pool_bytes must be None or an int >= 0"),
    ({"disk_cache_bytes": "x"}, "disk_cache_bytes must be an int >= 0, got 'x'"),
    ({"disk_cache_bytes": None}, "disk_cache_bytes must be an int >= 0, got None"),
    ({"cache_bytes": True}, "cache_bytes must be an int >= 0, got True"),
    ({"cache_bytes": 1e9}, "cache_bytes must be an int >= 0"),
    ({"chunk_tokens": 2.0}, "chunk_tokens must be an int >= 1"),
    ({"block_tokens": False}, "block_tokens must be an int >= 1"),
    ({"prefill_chunk_tokens": "64"}, "prefill_chunk_tokens must be an int >= 1"),
    ({"reply_memo_entries": None}, "reply_memo_entries must be an int >= 0"),
    ({"recompute_head_tokens": -1}, "recompute_head_tokens must be an int >= 0"),
    ({"check_layer": 1.0}, "check_layer must be an int >= 0"),
    ({"recompute_ratio": float("nan")}, r"recompute_ratio must be a number in \[0, 1\]"),
    ({"recompute_ratio": float("inf")}, r"recompute_ratio must be a number in \[0, 1\]"),
    ({"recompute_ratio": "0.1"}, r"recompute_ratio must be a number in \[0, 1\]"),
    ({"recompute_ratio": True}, r"recompute_ratio must be a number in \[0, 1\]"),
    ({"paged": "yes"}, "paged must be None, True or False"),
    ({"disk_kv_int8": 1}, "disk_kv_int8 must be True or False"),
    ({"disk_cache_dir": 5}, "disk_cache_dir must be None or a path"),
    ({"moved_reuse": None}, "moved_reuse must be one of"),
    ({"moved_selection": 1}, "moved_selection must be one of"),
    ({"max_running": 0}, "max_running must be an int >= 1"),
    ({"max_running": True}, "max_running must be an int >= 1"),
    ({"max_batch_tokens": 2.5}, "max_batch_tokens must be None or an int >= 1"),
    ({"max_batch_tokens": 4}, r"max_batch_tokens must be None or an int >= max_running \(16\)"),
    ({"max_waiting": "8"}, "max_waiting must be an int >= 0"),
    ({"queue_timeout_s": float("nan")}, "queue_timeout_s must be a finite number >= 0"),
    ({"queue_timeout_s": float("inf")}, "queue_timeout_s must be a finite number >= 0"),
    ({"queue_timeout_s": True}, "queue_timeout_s must be a finite number >= 0"),
    ({"queue_timeout_s": -1}, "queue_timeout_s must be a finite number >= 0"),
])
def test_every_numeric_option_is_type_checked(options, match):
    with pytest.raises(InputError, match=match):
        EngineConfig(**options)


def test_integer_like_options_are_stored_as_ints():
    config = EngineConfig(cache_bytes=numpy.int64(1 << 20), kv_pool_bytes=numpy.uint32(1 << 21))
    assert type(config.cache_bytes) is int and config.cache_bytes == 1 << 20
    assert type(config.kv_pool_bytes) is int and config.kv_pool_bytes == 1 << 21


def test_a_pool_larger_than_the_machine_is_refused_before_allocating():
    from tiny_models import tiny_model
    from transformers import AutoTokenizer
    from kvboost_engine.loading import default_model_dir
    from kvboost_engine.wiring import device_memory_bytes

    model, tokenizer = tiny_model("llama", max_position_embeddings=512), AutoTokenizer.from_pretrained(default_model_dir())
    ram = device_memory_bytes(torch.device("cpu"))
    if ram is None:
        pytest.skip("this platform does not report its physical memory")
    with pytest.raises(BudgetError, match=f"kv_pool_bytes={ram + 1} is more than the {ram} bytes of memory"):
        Engine(model, tokenizer, kv_pool_bytes=ram + 1)
    with pytest.raises(BudgetError, match="kv_pool_bytes"):
        Engine.from_pretrained(kv_pool_bytes=ram + 1)      # before loading the weights
    small, cold = Engine(model, tokenizer, kv_pool_bytes=1 << 20), Engine(model, tokenizer, cache_bytes=0)
    assert small.chat(OK, max_new_tokens=4).token_ids == cold.chat(OK, max_new_tokens=4).token_ids


def test_missing_model_paths(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        Engine.from_pretrained(tmp_path / "nope")
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        Engine.from_pretrained(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match="neither an HF model directory nor a .gguf"):
        Engine.from_pretrained(tmp_path / "weights.bin")


def test_unreachable_hub_fails_fast(monkeypatch):
    import time
    import huggingface_hub.constants
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)     # read once, at import
    started = time.perf_counter()
    with pytest.raises(ModelNotFoundError, match="(?s)could not load 'someorg/not-a-model'.*local HF directory"):
        Engine.from_pretrained("someorg/not-a-model")
    assert time.perf_counter() - started < 120              # offline: no network waits (normally milliseconds)


def test_unsupported_config_fails_before_loading_weights(tmp_path):
    from transformers import GPT2Config
    GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="'gpt2' is not supported.*llama"):
        Engine.from_pretrained(tmp_path)


def test_unsupported_gguf_architecture(tmp_path):
    from gguf_models import write_metadata
    path = tmp_path / "tiny.gguf"
    write_metadata(path, "gpt2")
    with pytest.raises(UnsupportedModelError, match="GGUF architecture 'gpt2' is not supported"):
        Engine.from_pretrained(path)
