"""weights=: the bf16/int8/int4 CPU formats (kernels, conversion cache, closeness to fp32, errors)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from kvboost_engine import Engine, InputError
from kvboost_engine.loading import default_model_dir, load_model_and_tokenizer
from kvboost_engine.weights import quantized
from kvboost_engine.weights.formats import (Bf16Linear, FormatEmbedding, Int4Linear, Int8Linear, pack_int4,
                                            quantize_int4_groups, quantize_int8_rows, unpack_int4)
from kvboost_integrations._options import engine_options
from tiny_models import tiny_model
from together import serial_and_together

CPU = torch.device("cpu")
FORMATS = ("bf16", "int8", "int4")
# The default model's greedy reply to QUESTION ("The sky on a clear day is often described as a
# deep, rich shade of") is the same in every format for at least its first MATCH_TOKENS tokens
# (measured: bf16 16, int8 14, int4 16 of 16), and its first-token logits stay within
# LOGIT_TOLERANCE of fp32's (largest absolute difference over the vocabulary; logits span ~30).
QUESTION = [{"role": "user", "content": "What color is the sky on a clear day?"}]
MATCH_TOKENS = 10
LOGIT_TOLERANCE = {"bf16": 0.75, "int8": 2.0, "int4": 2.0}


def linear_of(fmt: str, weight: torch.Tensor, bias=None):
    if fmt == "bf16":
        return Bf16Linear(weight, bias)
    if fmt == "int8":
        return Int8Linear(*quantize_int8_rows(weight), bias)
    codes, scale_zeros = quantize_int4_groups(weight)
    packed, block = pack_int4(codes)
    return Int4Linear(packed, scale_zeros, 32, block, bias)


@pytest.mark.parametrize("fmt", FORMATS)
def test_format_linear_tracks_float_in_both_paths(fmt):
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(128, 96, generator=gen) * 0.05, torch.randn(128, generator=gen)
    module = linear_of(fmt, weight, bias)
    for rows in (1, 3, module.dense_from_rows if module.dense_from_rows < 1 << 40 else 200):
        x = torch.randn(2, rows, 96, generator=gen)
        want, got = F.linear(x, weight, bias), module(x)
        assert got.shape == want.shape and got.dtype == torch.float32
        error = (got - want).norm() / want.norm()
        assert error < {"bf16": 0.01, "int8": 0.02, "int4": 0.1}[fmt], (rows, error)


def test_int4_dense_path_equals_kernel_up_to_bf16():
    gen = torch.Generator().manual_seed(1)
    module = linear_of("int4", torch.randn(192, 64, generator=gen))
    assert module.block, "this PyTorch's int4 pack layout is not the one unpack_int4 reads"
    x = torch.randn(80, 64, generator=gen).bfloat16()
    kernel, dense = module.matmul(x).float(), module.dense_matmul(x).float()
    assert ((kernel - dense).norm() / kernel.norm()) < 0.01


def test_int4_pack_roundtrip():
    codes = torch.randint(0, 16, (128, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(2))
    packed, block = pack_int4(codes)
    assert block in (64, 32)
    assert torch.equal(unpack_int4(packed, 128, 64, block), codes.to(torch.uint8))


def test_int8_embedding_rows():
    weight = torch.randn(50, 16)
    codes, scales = quantize_int8_rows(weight)
    embedding = FormatEmbedding(codes, scales, torch.float32)
    ids = torch.tensor([[0, 7, 49]])
    assert torch.allclose(embedding(ids), weight[ids], atol=0.02 * weight.abs().max().item())


def test_bad_weights_values_are_input_errors():
    with pytest.raises(InputError, match="weights must be one of"):
        Engine.from_pretrained(weights="int3")
    with pytest.raises(InputError, match="float32"):
        Engine.from_pretrained(weights="fp32", dtype="bf16")
    with pytest.raises(InputError, match="CPU format|no such CUDA device"):   # the latter where no GPU
        Engine.from_pretrained(weights="int8", device="cuda")


def test_framework_classes_accept_weights_in_engine_kwargs():
    assert engine_options({"weights": "int4"}) == {"weights": "int4"}
    with pytest.raises(InputError, match="weights"):
        engine_options({"weight": "int4"})


@pytest.fixture
def tiny_dir(tmp_path, monkeypatch):
    """A tiny untied Llama saved with the default tokenizer; converted weights go to a fresh cache dir."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    path = tmp_path / "tiny"
    tiny_model("llama", seed=3).save_pretrained(path)
    tokenizer.save_pretrained(path)
    monkeypatch.setenv("KVBOOST_HOME", str(tmp_path / "home"))
    return path


@pytest.mark.parametrize("fmt", FORMATS)
def test_second_load_reuses_the_converted_file(tiny_dir, monkeypatch, fmt):
    ids = torch.tensor([[5, 900, 17, 3000, 42]])
    first, _ = load_model_and_tokenizer(tiny_dir, device=CPU, dtype=torch.float32, weights=fmt)
    info = first.kvboost_weights
    assert not info.weights_from_cache and info.weights_format == fmt
    stamp = __import__("os").stat(info.weights_cache_file).st_mtime_ns

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again")
    monkeypatch.setattr(quantized, "_convert", no_conversion)
    second, _ = load_model_and_tokenizer(tiny_dir, device=CPU, dtype=torch.float32, weights=fmt)
    assert second.kvboost_weights.weights_from_cache
    assert second.kvboost_weights.weights_cache_file == info.weights_cache_file
    assert __import__("os").stat(info.weights_cache_file).st_mtime_ns == stamp
    with torch.no_grad():
        assert torch.equal(first(ids).logits, second(ids).logits)


def test_formats_have_their_own_files_and_fingerprints(tiny_dir):
    engines = {fmt: Engine.from_pretrained(tiny_dir, weights=fmt, cache_bytes=0) for fmt in ("bf16", "int8")}
    assert engines["bf16"].stats()["weights_cache_file"] != engines["int8"].stats()["weights_cache_file"]
    assert engines["bf16"].fingerprint != engines["int8"].fingerprint
    assert engines["int8"].stats()["weights_bytes"] < engines["bf16"].stats()["weights_bytes"]


def test_a_changed_cache_file_is_converted_again(tiny_dir):
    first, _ = load_model_and_tokenizer(tiny_dir, device=CPU, dtype=torch.float32, weights="int8")
    path = first.kvboost_weights.weights_cache_file
    with open(path, "r+b") as handle:
        handle.write(b"garbage!")
    again, _ = load_model_and_tokenizer(tiny_dir, device=CPU, dtype=torch.float32, weights="int8")
    assert not again.kvboost_weights.weights_from_cache


def test_a_cache_file_changed_in_place_is_converted_again(tiny_dir):
    """Bytes overwritten inside the file (its size and shapes as they were) loaded as the weights:
    the default model answered ''. A checksum in the file's metadata catches it."""
    first, _ = load_model_and_tokenizer(tiny_dir, device=CPU, dtype=torch.float32, weights="bf16")
    path = first.kvboost_weights.weights_cache_file
    size = os.path.getsize(path)
    with open(path, "r+b") as handle:
        handle.seek(size - 4096)
        handle.write(bytes(4096))
    again, _ = load_model_and_tokenizer(tiny_dir, device=CPU, dtype=torch.float32, weights="bf16")
    assert not again.kvboost_weights.weights_from_cache and os.path.getsize(path) == size
    third, _ = load_model_and_tokenizer(tiny_dir, device=CPU, dtype=torch.float32, weights="bf16")
    assert third.kvboost_weights.weights_from_cache


def test_a_cache_that_cannot_be_written_still_loads(tiny_dir, monkeypatch, caplog):
    """A full disk or a read-only cache failed the load although the conversion in memory had worked
    (weights="bf16": converted in memory; int4 / int8 stream into their pack, whose write error stays an OSError)."""
    from safetensors import SafetensorError

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: No space left on device (os error 28)")
    monkeypatch.setattr("safetensors.torch.save_file", full)
    with caplog.at_level("WARNING"):
        model, _ = load_model_and_tokenizer(tiny_dir, device=CPU, dtype=torch.float32, weights="bf16")
    assert not model.kvboost_weights.weights_from_cache and "No space left" in caplog.text
    assert not [p for p in os.listdir(os.path.dirname(model.kvboost_weights.weights_cache_file))
                if p.startswith(".convert-")]
    monkeypatch.undo()
    monkeypatch.setattr(quantized, "build_lock", lambda path: (_ for _ in ()).throw(PermissionError("read-only")))
    monkeypatch.setenv("KVBOOST_HOME", str(tiny_dir.parent / "home2"))
    model, _ = load_model_and_tokenizer(tiny_dir, device=CPU, dtype=torch.float32, weights="bf16")
    assert model.kvboost_weights.weights_format == "bf16"


@pytest.mark.parametrize("fmt", FORMATS)
def test_default_model_greedy_reply_matches_fp32(smol, fmt):
    model, tokenizer = smol
    reference = Engine(model, tokenizer, cache_bytes=0)
    want = reference.chat(QUESTION, max_new_tokens=MATCH_TOKENS)
    want_logits = reference.next_token_logits(messages=QUESTION)
    engine = Engine.from_pretrained(weights=fmt, cache_bytes=0)
    got = engine.chat(QUESTION, max_new_tokens=MATCH_TOKENS)
    assert got.token_ids == want.token_ids, (got.text, want.text)
    difference = (engine.next_token_logits(messages=QUESTION) - want_logits).abs().max().item()
    print(f"{fmt}: largest first-token logit difference {difference:.3f}")
    assert difference < LOGIT_TOLERANCE[fmt]


def test_batched_generation_with_int8_stays_close_to_serial():
    """Requests running together share forwards (Forward.batch): the int8 layers then see several
    rows at once. Quantized kernels are not batch-invariant (the kernel, and its summation order,
    depends on the rows in a forward: bf16 dense from 32 rows on), so a near tie late in a reply
    may break the other way; the replies start the same and every request completes."""
    engine = Engine.from_pretrained(weights="int8", cache_bytes=0)
    serial, batched = serial_and_together(engine)
    assert [b[:4] for b in batched] == [s[:4] for s in serial]
    assert all(len(b) == len(s) or 2 in b or 2 in s for b, s in zip(batched, serial))
    assert engine.cache.pool.usage()["in_use"] == 0
    assert engine.stats()["weights_format"] == "int8"


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_int_formats_convert_tensor_by_tensor_and_reload_without_the_float_file(tiny_dir, fmt, monkeypatch):
    """int4/int8 on CPU float32: the packed path (weights/hf_pack.py). Same codes and scales as the
    int4/int8 modules (the weights decode to what those modules decode to); the second load maps the
    converted file and never opens the float checkpoint."""
    from kvboost_engine.weights.formats import quantize_int4_groups
    from kvboost_engine.weights.packed import PackedLinear
    model, _ = load_model_and_tokenizer(tiny_dir, device=CPU, dtype=torch.float32, weights=fmt)
    assert not model.kvboost_weights.weights_from_cache
    down = model.model.layers[0].mlp.down_proj
    assert isinstance(down, PackedLinear) and down.bits == (4 if fmt == "int4" else 8)
    float_model = tiny_model("llama", seed=3)
    weight = float_model.model.layers[0].mlp.down_proj.weight.detach()
    if fmt == "int4":
        codes, scale_zeros = quantize_int4_groups(weight)
        n, k = weight.shape
        scale = scale_zeros[..., 0].T.float().repeat_interleave(32, dim=1)
        offset = scale_zeros[..., 1].T.float().repeat_interleave(32, dim=1) - 8 * scale
        assert torch.equal(down.dequantized(), codes.float() * scale + offset)
        # m is the quantizer's bf16 zero (code 8's value), not a float32 offset: 5 bits a weight
        assert (down.m.dtype, down.m_code, down.zero_code) == (torch.bfloat16, 8, None)
    head = model.lm_head                      # int8, m = -128 d: the native step derives m, reads d only
    assert (head.bits, head.zero_code, head.m.dtype) == (8, 128, torch.bfloat16)
    assert torch.equal(head.m.float(), -128 * head.d.float())
    import transformers

    from kvboost_engine.weights import hf_pack
    monkeypatch.setattr(hf_pack, "SafetensorsFile", lambda *a, **k: pytest.fail("opened the float checkpoint"))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("loaded the float model"))
    again, _ = load_model_and_tokenizer(tiny_dir, device=CPU, dtype=torch.float32, weights=fmt)
    assert again.kvboost_weights.weights_from_cache
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, again(ids).logits)


def test_a_new_conversion_removes_the_superseded_one_of_its_checkpoint(tiny_dir):
    """The int4 / int8 conversion of a checkpoint (keyed by its files' sizes and mtimes) went on
    disk for good each time the checkpoint changed."""
    from kvboost_engine.weights.hf_pack import _target
    load_model_and_tokenizer(tiny_dir, device=CPU, dtype=torch.float32, weights="int4")
    load_model_and_tokenizer(tiny_dir, device=CPU, dtype=torch.float32, weights="int8")
    old, int8 = _target(tiny_dir, "int4"), _target(tiny_dir, "int8")
    os.utime(next(tiny_dir.glob("*.safetensors")), ns=(1, 1))          # the checkpoint changed
    load_model_and_tokenizer(tiny_dir, device=CPU, dtype=torch.float32, weights="int4")
    new = _target(tiny_dir, "int4")
    assert new != old and new.is_dir() and not old.exists()
    assert int8.is_dir()                                                # another format's conversion stays


def test_a_load_that_cannot_fit_is_refused_up_front_with_the_figures(tiny_dir, monkeypatch):
    from kvboost_engine.errors import BudgetError
    from kvboost_engine.weights import memory
    monkeypatch.setattr(memory, "available_bytes", lambda: 1 << 20)
    with pytest.raises(BudgetError, match=r"needs 0\.\d\d GiB but the memory available .* is 0\.00 GiB"):
        load_model_and_tokenizer(tiny_dir, device=CPU, dtype=torch.float32)
    with pytest.raises(BudgetError, match="weights='int4'"):
        load_model_and_tokenizer(tiny_dir, device=CPU, dtype=torch.float32, weights="int4")


def test_a_checkpoint_whose_config_disagrees_is_refused_when_packed(tmp_path, monkeypatch):
    """weights="int4" packs the safetensors itself: a config.json whose head counts disagree with the
    tensors is an InputError naming the tensor (it loaded, and every request then failed)."""
    import json

    from transformers import AutoTokenizer

    from kvboost_engine import Engine, InputError
    from kvboost_engine.loading import default_model_dir
    from tiny_models import tiny_model

    source = tmp_path / "tiny"
    tiny_model("llama", seed=5).save_pretrained(source)
    AutoTokenizer.from_pretrained(default_model_dir()).save_pretrained(source)     # the shared cache's default model
    monkeypatch.setenv("KVBOOST_HOME", str(tmp_path / "home"))
    config = json.loads((source / "config.json").read_text())
    config["num_key_value_heads"] = config["num_attention_heads"]           # the tensors hold fewer
    (source / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match=r"tensor model.layers.0.self_attn.k_proj.weight is \[.*\], but the model"):
        Engine.from_pretrained(source, weights="int4", device="cpu")


@pytest.mark.parametrize("weights", [None, "int4"])
def test_a_checkpoint_missing_a_tensor_is_refused_naming_it(tmp_path, monkeypatch, weights):
    """transformers fills a tensor the checkpoint lacks with random values (a load report on stderr
    the only sign): the model loaded and answered garbage; int4 / int8 fell back to that float load
    and packed it."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    source = tmp_path / "tiny"
    tiny_model("llama", seed=5).save_pretrained(source)
    AutoTokenizer.from_pretrained(default_model_dir()).save_pretrained(source)     # the shared cache's default model
    monkeypatch.setenv("KVBOOST_HOME", str(tmp_path / "home"))
    stored = load_file(source / "model.safetensors")
    del stored["model.layers.1.mlp.gate_proj.weight"]
    save_file(stored, source / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(InputError, match=r"lacks tensor model.layers.1.mlp.gate_proj.weight \(1 missing in all\)"):
        Engine.from_pretrained(source, weights=weights, device="cpu")
    assert not (tmp_path / "home" / "packed").exists() or not list((tmp_path / "home" / "packed").glob("tiny-*"))


def test_a_damaged_checkpoint_file_and_an_unknown_rope_type_are_named(tmp_path, monkeypatch):
    """safetensors' "header too large" named no file (of a checkpoint's shards); a rope_type transformers
    does not know was a bare KeyError from its build."""
    import json

    from transformers import AutoTokenizer

    from kvboost_engine import UnsupportedModelError
    source = tmp_path / "tiny"
    tiny_model("llama", seed=5).save_pretrained(source, max_shard_size="100KB")
    AutoTokenizer.from_pretrained(default_model_dir()).save_pretrained(source)     # the shared cache's default model
    monkeypatch.setenv("KVBOOST_HOME", str(tmp_path / "home"))
    shard = sorted(source.glob("*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[:8] = (2**60).to_bytes(8, "little")
    shard.write_bytes(bytes(data))
    with pytest.raises(InputError, match=rf"{shard.name} is damaged or cut short"):
        Engine.from_pretrained(source, device="cpu")
    config = json.loads((source / "config.json").read_text())
    key = "rope_parameters" if "rope_parameters" in config else "rope_scaling"
    config[key] = {**(config.get(key) or {}), "rope_type": "ntk-by-parts", "factor": 2.0}
    (source / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="rope_type 'ntk-by-parts' is not supported"):
        Engine.from_pretrained(source, device="cpu")


def test_the_memory_estimate_counts_the_files_transformers_loads(tmp_path):
    """Mistral repositories ship consolidated.safetensors beside the HF files: the same weights again
    (the estimate doubled, which could refuse a model that fits)."""
    import json

    from kvboost_engine.weights.memory import model_files

    for name in ("model.safetensors", "consolidated.safetensors"):
        (tmp_path / name).write_bytes(b"x")
    assert [f.name for f in model_files(tmp_path)] == ["model.safetensors"]
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "extra.safetensors"):
        (sharded / name).write_bytes(b"x")
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    assert [f.name for f in model_files(sharded)] == ["model-00001-of-00002.safetensors",
                                                       "model-00002-of-00002.safetensors"]
