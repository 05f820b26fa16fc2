"""A GGUF's rotary scaling (weights/gguf_rope.py): Llama 3.x's rope_freqs, linear (Gemma 3 4B+), YaRN
and their refusals. Tiny files written as llama.cpp's converter writes the scaling; the loaded model's
rotary frequencies and scaling, as stored (packed) and converted to float, must equal those of the
same architecture built by transformers from the model's own settings."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvboost_engine.errors import UnsupportedModelError
from kvboost_engine.loading import converted_gguf_dir, load_model_and_tokenizer
from kvboost_engine.model import compat
from kvboost_engine.model.arch import SUPPORTED_ARCHITECTURES
from kvboost_engine.weights.gguf_model import packed_gguf_dir
from kvboost_engine.weights.gguf_rope import llama3_divisors, llama3_settings

from gguf_models import Q, llama3_divisors as converter_divisors, native_tracks_torch, write_model

CPU, F32 = torch.device("cpu"), torch.float32


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBOOST_HOME", str(tmp_path / "home"))


def _rotary(model) -> dict:
    """Every rotary frequency buffer and scaling of a model, by name."""
    out = {name: buf.clone() for name, buf in model.named_buffers() if name.endswith("inv_freq")}
    out.update({f"{name}.attention_scaling": torch.tensor(float(m.attention_scaling))
                for name, m in model.named_modules() if hasattr(m, "attention_scaling")})
    assert out
    return out


def _reference(loaded, params: dict):
    """The loaded model's architecture built by transformers with `params` as its rope settings."""
    from transformers import AutoModelForCausalLM
    config = type(loaded.config).from_dict(loaded.config.to_dict())
    for key, value in compat.config_settings({"rope_parameters": params}, config.model_type).items():
        setattr(config, key, value)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _check(path, params: dict):
    for folder in (packed_gguf_dir(path), converted_gguf_dir(path)):
        model, _ = load_model_and_tokenizer(folder, device=CPU, dtype=F32)
        want, got = _rotary(_reference(model, params)), _rotary(model)
        assert want.keys() == got.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=2e-5, atol=0, msg=name)


LLAMA3 = [dict(theta=500000.0, factor=8.0, low=1.0, high=4.0, context=8192),       # Llama 3.1: 3 frequencies on the ramp
          dict(theta=500000.0, factor=32.0, low=1.0, high=4.0, context=8192),      # Llama 3.2
          dict(theta=10000.0, factor=8.0, low=1.0, high=1.5, context=8192),        # one on the ramp
          dict(theta=10000.0, factor=8.0, low=1.0, high=1.1, context=8192)]        # none


@pytest.mark.parametrize("case", LLAMA3, ids=lambda c: f"f{c['factor']:g}-h{c['high']:g}-t{c['theta']:g}")
def test_llama3_rope_freqs_load_as_the_models_llama3_rotary(tmp_path, case):
    path = tmp_path / "l3.gguf"
    write_model(path, "llama", Q.Q8_0, embed=Q.Q8_0, theta=case["theta"], context=131072,
                rope={"type": "llama3", **{k: case[k] for k in ("factor", "low", "high", "context")}})
    _check(path, {"rope_type": "llama3", "rope_theta": case["theta"], "factor": case["factor"],
                  "low_freq_factor": case["low"], "high_freq_factor": case["high"],
                  "original_max_position_embeddings": case["context"]})
    model, _ = load_model_and_tokenizer(packed_gguf_dir(path), device=CPU, dtype=F32)
    settings = compat.rope_parameters(model.config)
    assert settings["rope_type"] == "llama3" and settings["factor"] == case["factor"]
    if case["high"] == 4.0:                      # enough of a ramp to fix both: the model's own settings back
        assert (settings["low_freq_factor"], settings["high_freq_factor"]) == (1.0, 4.0)


@pytest.mark.parametrize("dim", [64, 128])
def test_llama3_settings_solve_the_converters_divisors(dim):
    for case in LLAMA3:
        divisors = converter_divisors(case["theta"], dim, case["factor"], case["low"], case["high"], case["context"])
        settings = llama3_settings(divisors, case["theta"], dim)
        np.testing.assert_allclose(llama3_divisors(settings, dim), divisors, rtol=3e-6)


def test_divisors_of_no_llama3_rotary_are_refused():
    with pytest.raises(UnsupportedModelError, match="not llama3"):
        llama3_settings(np.linspace(4.0, 1.0, 32), 10000.0, 64)         # falling: no such ramp
    with pytest.raises(UnsupportedModelError, match="not llama3"):
        llama3_settings(np.ones(32), 10000.0, 64)                        # nothing scaled
    bumpy = converter_divisors(500000.0, 64, 8.0, 1.0, 4.0, 8192).astype(np.float64)
    bumpy[16] *= 1.3                                                     # one off the ramp's line
    with pytest.raises(UnsupportedModelError, match="not llama3"):
        llama3_settings(bumpy, 500000.0, 64)
    with pytest.raises(UnsupportedModelError, match="64 values"):
        llama3_settings(np.ones(64) * 2, 10000.0, 64)                   # one per frequency: 32 for 64 dimensions


def test_linear_and_yarn_scaling_load(tmp_path):
    linear = tmp_path / "linear.gguf"
    write_model(linear, "llama", Q.Q8_0, embed=Q.Q8_0, rope={"type": "linear", "factor": 4.0})
    _check(linear, {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})
    yarn = tmp_path / "yarn.gguf"
    write_model(yarn, "qwen2", Q.Q8_0, embed=Q.Q8_0, bias=True, theta=1e6,
                rope={"type": "yarn", "factor": 4.0, "original_context": 512, "beta_fast": 16.0, "attn_factor": 1.2})
    _check(yarn, {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 512,
                  "beta_fast": 16.0, "attention_factor": 1.2})
    plain_yarn = tmp_path / "plain_yarn.gguf"
    write_model(plain_yarn, "qwen3", Q.Q8_0, embed=Q.Q8_0, rope={"type": "yarn", "factor": 4.0, "original_context": 512})
    _check(plain_yarn, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 512})


@pytest.mark.skipif("gemma3_text" not in SUPPORTED_ARCHITECTURES, reason="Gemma 3 needs transformers 5")
def test_gemma3_linear_scaling_is_its_global_layers(tmp_path):
    """Gemma 3 4B and larger scale the rotary of their global layers linearly (8x); the local layers
    keep their own base."""
    path = tmp_path / "g.gguf"
    write_model(path, "gemma3", Q.Q8_0, embed=Q.Q8_0, theta=1e6, rope={"type": "linear", "factor": 8.0})
    model, _ = load_model_and_tokenizer(packed_gguf_dir(path), device=CPU, dtype=F32)
    settings = compat.rope_parameters(model.config)
    assert settings["full_attention"] == {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}
    assert settings["sliding_attention"]["rope_type"] == "default"
    _check(path, {**settings, "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}})


def test_unknown_scaling_is_refused_not_dropped(tmp_path):
    for name, rope in (("odd", {"type": "dynamic", "factor": 2.0}),
                       ("ext", {"type": "yarn", "factor": 4.0, "original_context": 512, "ext_factor": 0.5})):
        path = tmp_path / f"{name}.gguf"
        write_model(path, "llama", Q.Q8_0, embed=Q.Q8_0, rope=rope)
        with pytest.raises(UnsupportedModelError, match="dynamic|yarn_ext_factor"):
            packed_gguf_dir(path)
        with pytest.raises(UnsupportedModelError, match="dynamic|yarn_ext_factor"):
            converted_gguf_dir(path)


def test_longrope_factors_become_phi3s_settings(tmp_path):
    """Phi-3 128k: the converter writes long and short factors as tensors and the attention factor and
    original context as keys; they come back as transformers' longrope settings, which its Phi-3 accepts."""
    from gguf import GGUFWriter
    from transformers import AutoConfig
    from kvboost_engine.weights.gguf_file import GGUFFile
    from kvboost_engine.weights.gguf_rope import scaled_rope
    rng = np.random.default_rng(0)
    long, short = (1 + rng.random(16).astype(np.float32) * k for k in (30, 2))
    path = tmp_path / "phi3.gguf"
    w = GGUFWriter(str(path), "phi3")
    w.add_string("phi3.rope.scaling.type", "longrope")
    w.add_rope_scaling_attn_factors(1.19)
    w.add_rope_scaling_orig_ctx_len(4096)
    w.add_tensor("rope_factors_long.weight", long)
    w.add_tensor("rope_factors_short.weight", short)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    settings = scaled_rope(GGUFFile(path), {"rope_type": "default", "rope_theta": 10000.0}, 32)
    assert settings["rope_type"] == "longrope" and settings["original_max_position_embeddings"] == 4096
    assert settings["attention_factor"] == pytest.approx(1.19)
    np.testing.assert_array_equal(settings["long_factor"], long)
    np.testing.assert_array_equal(settings["short_factor"], short)
    config = AutoConfig.for_model("phi3", **compat.config_settings(
        dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=1, intermediate_size=256,
             vocab_size=64, max_position_embeddings=131072, rope_parameters=settings), "phi3"))
    assert compat.rope_parameters(config)["rope_type"] == "longrope"


@pytest.mark.parametrize("rope,params", [
    ({"type": "llama3", "factor": 8.0, "low": 1.0, "high": 4.0, "context": 8192},
     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192}),
    ({"type": "linear", "factor": 4.0}, {"rope_type": "linear", "factor": 4.0}),
    ({"type": "yarn", "factor": 4.0, "original_context": 512}, {"rope_type": "yarn", "factor": 4.0,
                                                               "original_max_position_embeddings": 512})], ids=str)
def test_apply_puts_the_scaling_into_a_config(tmp_path, rope, params):
    """apply_gguf_rope on a config as this transformers version builds it (4.x: rope_theta and rope_scaling;
    5.x: rope_parameters), from a file holding only the scaling: the model built from the config has the
    rotary of one built from the settings."""
    from gguf import GGUFWriter
    from transformers import AutoConfig, AutoModelForCausalLM
    from kvboost_engine.weights.gguf_file import GGUFFile
    from kvboost_engine.weights.gguf_rope import apply_gguf_rope
    from gguf_models import add_rope_scaling
    path = tmp_path / "scaling.gguf"
    w = GGUFWriter(str(path), "llama")
    add_rope_scaling(w, rope, 64, 500000.0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    shape = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1, intermediate_size=256,
                 vocab_size=64, max_position_embeddings=131072)
    config = AutoConfig.for_model("llama", **compat.config_settings(
        {**shape, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}, "llama"))
    apply_gguf_rope(config, GGUFFile(path))
    assert compat.rope_parameters(config)["rope_type"] == params["rope_type"]
    want = AutoConfig.for_model("llama", **compat.config_settings(
        {**shape, "rope_parameters": {"rope_theta": 500000.0, **params}}, "llama"))
    got, ref = (_rotary(AutoModelForCausalLM.from_config(c)) for c in (config, want))
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=2e-5, atol=0, msg=name)


def test_the_native_step_takes_the_scaled_rotary(tmp_path):
    """A Llama 3 file as stored decodes natively with its llama3 rotary (the step reads the model's
    own cos / sin tables, static for llama3): its logits track the PyTorch loop over the same codes."""
    from kvboost_engine.native import build
    if build.cpu_reason() or not build.compiler():
        pytest.skip("the native step cannot run here")
    path = tmp_path / "l3.gguf"
    write_model(path, "llama", Q.Q4_0, embed=Q.Q8_0, theta=500000.0, context=131072,
                rope={"type": "llama3", "factor": 8.0, "low": 1.0, "high": 4.0, "context": 8192})
    model, _ = load_model_and_tokenizer(packed_gguf_dir(path), device=CPU, dtype=F32)
    assert compat.rope_parameters(model.config)["rope_type"] == "llama3"
    native_tracks_torch(model, [256] + [72, 101, 108, 108, 111, 32] * 40, steps=4, capacity=512)


@pytest.mark.skipif("gemma3_text" not in SUPPORTED_ARCHITECTURES, reason="Gemma 3 needs transformers 5")
def test_gemma3_attention_scale_follows_llama_cpp(tmp_path):
    """A GGUF has no query_pre_attn_scalar: llama.cpp uses head_dim, and hidden / heads for the 62-layer
    27B (168); transformers' reader left its default, 256, which only the 256-wide heads of 270M-12B
    match. The tiny file's heads are 64 wide."""
    from types import SimpleNamespace
    from kvboost_engine.weights.gguf_config import gemma3_query_scalar
    path = tmp_path / "g.gguf"
    write_model(path, "gemma3", Q.Q8_0, embed=Q.Q8_0)
    for folder in (packed_gguf_dir(path), converted_gguf_dir(path)):
        model, _ = load_model_and_tokenizer(folder, device=CPU, dtype=F32)
        assert model.config.query_pre_attn_scalar == 64
    gemma_27b = SimpleNamespace(num_hidden_layers=62, hidden_size=5376, num_attention_heads=32, head_dim=128)
    gemma_4b = SimpleNamespace(num_hidden_layers=34, hidden_size=2560, num_attention_heads=8, head_dim=256)
    assert (gemma3_query_scalar(gemma_27b), gemma3_query_scalar(gemma_4b)) == (168, 256)


def test_a_yarn_rotary_is_tabled_for_the_native_step(tmp_path):
    """YaRN's frequencies and attention factor do not depend on the sequence length (transformers
    updates only "dynamic" and longrope in the forward), so the step reads them from one table: the
    numbers the model's rotary gives at each position, and its logits track the PyTorch loop."""
    from kvboost_engine.model.arch import ModelAdapter
    from kvboost_engine.native import build
    from kvboost_engine.native.decoder import native_decoder
    if build.cpu_reason() or not build.compiler():
        pytest.skip("the native step cannot run here")
    path = tmp_path / "yarn.gguf"
    write_model(path, "qwen2", Q.Q8_0, embed=Q.Q8_0, bias=True, theta=1e6,
                rope={"type": "yarn", "factor": 4.0, "original_context": 128, "attn_factor": 1.2})
    model, _ = load_model_and_tokenizer(packed_gguf_dir(path), device=CPU, dtype=F32)
    decoder, reason = native_decoder(ModelAdapter(model), threads=2)
    assert decoder is not None, reason
    assert decoder._static_rope
    positions = (0, 1, 127, 128, 300, 1500)
    tabled = [decoder._rotary(p) for p in positions]
    decoder._static_rope = False                        # each position from the model's rotary module
    direct = [decoder._rotary(p) for p in positions]
    assert all(torch.equal(a, b) for t, d in zip(tabled, direct) for a, b in zip(t, d))
    assert not torch.equal(direct[-1][0], torch.cos(torch.zeros_like(direct[-1][0])))
    decoder.close()
    native_tracks_torch(model, [256] + [72, 101, 108, 108, 111, 32] * 40, steps=4, capacity=512)


def test_phi3_longrope_keeps_the_files_original_window_when_read_back(tmp_path):
    """Phi3Config's own original_max_position_embeddings (4096 by default) won over rope_parameters'
    when the converted folder's config.json was read back: the file said 8192."""
    import numpy as np
    from gguf import GGUFWriter
    from transformers import AutoConfig
    from kvboost_engine.model import compat
    from kvboost_engine.weights.gguf_file import GGUFFile
    from kvboost_engine.weights.gguf_rope import apply_gguf_rope
    path = tmp_path / "phi3.gguf"
    writer = GGUFWriter(str(path), "phi3")
    writer.add_string("phi3.rope.scaling.type", "longrope")
    writer.add_rope_scaling_attn_factors(1.19)
    writer.add_rope_scaling_orig_ctx_len(8192)
    writer.add_tensor("rope_factors_long.weight", np.linspace(1, 30, 8).astype(np.float32))
    writer.add_tensor("rope_factors_short.weight", np.linspace(1, 2, 8).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = AutoConfig.for_model("phi3", hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                                  num_hidden_layers=1, intermediate_size=128, vocab_size=64,
                                  max_position_embeddings=131072)
    apply_gguf_rope(config, GGUFFile(path))
    config.save_pretrained(tmp_path / "saved")
    again = compat.fix_loaded_config(AutoConfig.from_pretrained(tmp_path / "saved"))
    assert compat.rope_parameters(again)["original_max_position_embeddings"] == 8192
