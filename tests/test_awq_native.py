"""AWQ on the native step (awq_kernel="native", the CPU default where the step runs): its layers are
PackedLinear modules holding AWQ's weights exactly, the native step runs every step of them, reuse
is token-exact, and streaming, bfloat16 or shapes the step does not read keep the other kernels."""
from __future__ import annotations

import json

import pytest
import torch

from awq_helpers import write_tiny_awq
from kvboost_engine import Engine, InputError
from kvboost_engine.kv.contiguous import SequenceKV
from kvboost_engine.model.forward import Forward
from kvboost_engine.native import build
from kvboost_engine.native.decoder import native_decoder
from kvboost_engine.weights.awq.format import dequantize
from kvboost_engine.weights.awq.kernels import cpu_int4pack_works, select_layout
from kvboost_engine.weights.awq.linear import AWQLinear
from kvboost_engine.weights.awq.loader import load_awq_model
from kvboost_engine.weights.checkpoint import Checkpoint
from kvboost_engine.weights.packed import PackedLinear

CPU = torch.device("cpu")
IDS = [5, 17, 300, 2, 9, 44, 1200, 7]
native_runs = pytest.mark.skipif(not build.runs_here(), reason="the native step does not run on this machine")


@pytest.fixture(scope="module")
def qwen2_awq(tmp_path_factory):
    """A tiny Qwen2 (q/k/v biases) as an AWQ checkpoint, groups of 64."""
    path = tmp_path_factory.mktemp("awq") / "tiny-qwen2-awq"
    write_tiny_awq(path, "qwen2", group_size=64, search=False)
    return path


def test_native_layers_hold_awqs_weights_exactly(qwen2_awq):
    model = load_awq_model(qwen2_awq, device=CPU, dtype=torch.float32, kernel="native")
    ckpt = Checkpoint(qwen2_awq)
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, PackedLinear)]
    assert layers and not any(isinstance(m, AWQLinear) for m in model.modules())
    for name, module in layers:
        want = dequantize(ckpt.read(f"{name}.qweight"), ckpt.read(f"{name}.qzeros"), ckpt.read(f"{name}.scales"), 64)
        assert torch.equal(module.dequantized(), want.T)       # q * d + m: (q - zero) * scale, exactly
        if f"{name}.bias" in ckpt:
            assert torch.equal(module.bias, ckpt.read(f"{name}.bias").float())
    info = model.kvboost_awq
    assert (info.awq_kernel, info.streamed_layers, info.pack_file) == ("native", 0, None)
    assert info.resident_layer_bytes == sum(b.numel() * b.element_size() for _, m in layers for b in m.buffers())


@native_runs
def test_the_engine_runs_awq_natively_with_exact_reuse(qwen2_awq):
    engine = Engine.from_pretrained(qwen2_awq)                  # the default kernel on this CPU
    stats = engine.stats()
    assert (stats["awq_kernel"], stats["native_decode"], stats["native_prefill"]) == ("native", True, True)
    assert "native" in engine.model.config.quantization_config["kvboost_kernels"]
    cold = Engine.from_pretrained(qwen2_awq, cache_bytes=0)
    prefix = "one two three four five six seven eight nine ten " * 4
    for text in (prefix + "eleven", prefix + "twelve", prefix + "twelve"):
        got = engine.generate(text, max_new_tokens=12, min_new_tokens=12)
        assert got.token_ids == cold.generate(text, max_new_tokens=12, min_new_tokens=12).token_ids
    assert got.reused_tokens > 0 and engine.stats()["native_fallback_steps"] == {}


@native_runs
def test_native_logits_track_the_dequantized_model(qwen2_awq):
    """int8 activations per block of 32 against float32 ones: close, not equal."""
    engine = Engine.from_pretrained(qwen2_awq, cache_bytes=0)
    adapter = engine.adapter
    kv = SequenceKV(adapter.geometry, len(IDS), adapter.device)
    with torch.inference_mode():
        got = Forward(adapter, native_decoder(adapter)[0])(kv, IDS, 0).float()
        want = load_awq_model(qwen2_awq, device=CPU, dtype=torch.float32, kernel="dequant")(
            torch.tensor([IDS])).logits[0, -1]
    assert torch.nn.functional.cosine_similarity(got, want, dim=0) > 0.999
    assert (got - want).norm() < 0.05 * want.norm()


@pytest.mark.parametrize("options", [{"resident_layers": 1}, {"resident_bytes": 1 << 30}])
def test_native_keeps_every_layer_resident(qwen2_awq, options):
    with pytest.raises(InputError, match="every layer resident"):
        load_awq_model(qwen2_awq, device=CPU, dtype=torch.float32, kernel="native", **options)
    model = load_awq_model(qwen2_awq, device=CPU, dtype=torch.float32, native=True, **options)   # the default
    assert "native" not in model.kvboost_awq.awq_kernel                                          # streams as before
    if getattr(model, "kvboost_streamer", None) is not None:
        model.kvboost_streamer.close()
    everything = load_awq_model(qwen2_awq, device=CPU, dtype=torch.float32, kernel="native", resident_layers=99)
    assert everything.kvboost_awq.awq_kernel == "native"


def test_the_default_elsewhere_is_as_before(qwen2_awq):
    before = "cpu-int4pack" if cpu_int4pack_works() else "dequant"
    for options in ({"native": False}, {"native": True, "dtype": torch.bfloat16}):
        model = load_awq_model(qwen2_awq, device=CPU, **{"dtype": torch.float32, **options})
        assert model.kvboost_awq.awq_kernel == before
    with pytest.raises(InputError, match="runs on the CPU"):
        select_layout(torch.device("cuda"), "native")


def test_the_default_is_native_only_where_the_step_would_run(tmp_path):
    """k / v of 8 rows (the step reads tiles of 16), a layer the checkpoint keeps dense, Phi-3: the
    native layout loaded them all the same, the step stayed off and every layer dequantized to float32
    per forward (8x slower than cpu-int4pack in a review). Named, "native" keeps what it can."""
    from kvboost_tools.awq.quantize import quantized_state, save_checkpoint
    from kvboost_engine.loading import default_model_dir
    from tiny_models import tiny_model
    write_tiny_awq(tmp_path / "kv8", "llama", search=False, num_hidden_layers=2, num_attention_heads=8,
                   num_key_value_heads=1)
    phi3 = tiny_model("phi3", num_hidden_layers=2)
    save_checkpoint(phi3, quantized_state(phi3, 32, {}), tmp_path / "phi3", 32, default_model_dir())
    dense = tiny_model("llama", num_hidden_layers=2)
    state = quantized_state(dense, 32, {})
    for leaf in ("qweight", "qzeros", "scales"):
        state.pop(f"model.layers.0.mlp.down_proj.{leaf}")
    state["model.layers.0.mlp.down_proj.weight"] = dense.model.layers[0].mlp.down_proj.weight.detach().half()
    save_checkpoint(dense, state, tmp_path / "dense", 32, default_model_dir())
    config = json.loads((tmp_path / "dense" / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = ["model.layers.0.mlp.down_proj"]
    (tmp_path / "dense" / "config.json").write_text(json.dumps(config))
    for name in ("kv8", "phi3", "dense"):
        model = load_awq_model(tmp_path / name, device=CPU, dtype=torch.float32, native=True)
        assert not any(isinstance(m, PackedLinear) for m in model.modules()), name
        assert "native" not in model.kvboost_awq.awq_kernel, name
    model = load_awq_model(tmp_path / "kv8", device=CPU, dtype=torch.float32, kernel="native")
    kinds = {name.rsplit(".", 1)[-1]: type(m) for name, m in model.model.layers[0].named_modules()
             if isinstance(m, (AWQLinear, PackedLinear))}
    assert kinds["k_proj"] is AWQLinear and kinds["q_proj"] is PackedLinear
    assert model.kvboost_awq.awq_kernel == "dequant,native"
    engine = Engine.from_pretrained(tmp_path / "kv8", cache_bytes=0, awq_kernel="native")
    assert len(engine.generate("Hello", max_new_tokens=3, min_new_tokens=3).token_ids) == 3
    reason = engine.stats()["native_decode_off"]
    assert engine.stats()["native_decode"] is False and "AWQ layers run awq_kernel dequant" in reason
    assert "model.layers.0.self_attn.k_proj, 8 x 64" in reason
    kept = Engine.from_pretrained(tmp_path / "dense", cache_bytes=0, awq_kernel="native").stats()["native_decode_off"]
    assert "keeps 1 decoder linear layers unquantized" in kept
