"""Bad input: a clear error naming the limit, and the engine stays usable."""
import pytest

from kvboost_engine import ContextWindowError, Engine, InputError, ModelNotFoundError, UnsupportedModelError

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
    (lambda e: e.chat(OK, stop=[3]), "stop must be a string or a list of strings"),
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


def test_missing_model_paths(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        Engine.from_pretrained(tmp_path / "nope")
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        Engine.from_pretrained(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match="neither an HF model directory nor a .gguf"):
        Engine.from_pretrained(tmp_path / "weights.bin")


def test_unreachable_hub_fails_fast(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match="not in the local Hugging Face cache"):
        Engine.from_pretrained("someorg/not-a-model")


def test_unsupported_config_fails_before_loading_weights(tmp_path):
    from transformers import GPT2Config
    GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="'gpt2' is not supported.*llama"):
        Engine.from_pretrained(tmp_path)


def test_unsupported_gguf_architecture(tmp_path):
    import gguf
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="GGUF architecture 'gpt2' is not supported"):
        Engine.from_pretrained(path)
