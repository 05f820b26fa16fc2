"""AWQ checkpoints end to end: our producer's format, loading through Engine, clear errors."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from awq_helpers import write_tiny_awq
from kvboost_engine import Engine, InputError, UnsupportedModelError
from kvboost_engine.weights.checkpoint import Checkpoint
from kvboost_engine.weights.awq.linear import AWQLinear
from kvboost_engine.weights.awq.loader import load_awq_model
from kvboost_engine.loading import default_model_dir

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def qwen2_awq(tmp_path_factory):
    """A tiny Qwen2 (q/k/v biases) as an AWQ checkpoint, and its float model."""
    path = tmp_path_factory.mktemp("awq") / "tiny-qwen2-awq"
    reference = write_tiny_awq(path, "qwen2", group_size=64)
    return path, reference


def test_producer_writes_autoawq_gemm_layout(qwen2_awq):
    path, _ = qwen2_awq
    config = json.loads((path / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True,
                                             "version": "gemm", "modules_to_not_convert": None}
    entries = Checkpoint(path).entries
    prefix = "model.layers.0.self_attn.k_proj"          # in 64, out 32 (2 kv heads x 16)
    assert entries[f"{prefix}.qweight"].shape == (64, 4) and entries[f"{prefix}.qweight"].dtype == torch.int32
    assert entries[f"{prefix}.qzeros"].shape == (1, 4) and entries[f"{prefix}.qzeros"].dtype == torch.int32
    assert entries[f"{prefix}.scales"].shape == (1, 32) and entries[f"{prefix}.scales"].dtype == torch.float16
    assert entries[f"{prefix}.bias"].dtype == torch.float16
    assert f"{prefix}.weight" not in entries
    assert entries["model.embed_tokens.weight"].dtype == torch.float16


@pytest.mark.parametrize("kernel", ["dequant", "cpu-int4pack"])
def test_awq_model_tracks_float_model(qwen2_awq, kernel):
    path, reference = qwen2_awq
    model = load_awq_model(path, device=CPU, dtype=torch.float32, kernel=kernel)
    assert isinstance(model.model.layers[0].self_attn.q_proj, AWQLinear)
    ids = torch.tensor([[3, 99, 1500, 7, 42, 8]])
    with torch.no_grad():
        want, got = reference(ids).logits, model(ids).logits
    assert (got - want).norm() / want.norm() < 0.2
    assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.98


def test_kernels_agree(qwen2_awq):
    path, _ = qwen2_awq
    ids = torch.tensor([[3, 99, 1500, 7]])
    with torch.no_grad():
        a = load_awq_model(path, device=CPU, dtype=torch.float32, kernel="dequant")(ids).logits
        b = load_awq_model(path, device=CPU, dtype=torch.float32, kernel="cpu-int4pack")(ids).logits
    assert (a - b).abs().max() < 0.02 * a.abs().max()


def test_engine_recognises_awq_checkpoint(qwen2_awq):
    path, _ = qwen2_awq
    engine = Engine.from_pretrained(path, cache_bytes=0)
    gen = engine.generate("Hello there", max_new_tokens=4, min_new_tokens=4)
    assert len(gen.token_ids) == 4
    stats = engine.stats()
    assert stats["awq_group_size"] == 64 and stats["streamed_layers"] == 0
    assert stats["weights_digest"] in repr(engine.model.config.quantization_config)


def test_gemv_checkpoint_fails_clearly(qwen2_awq, tmp_path):
    path, _ = qwen2_awq
    gemv = tmp_path / "gemv"
    shutil.copytree(path, gemv)
    config = json.loads((gemv / "config.json").read_text())
    config["quantization_config"]["version"] = "gemv"
    (gemv / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="GEMM layout only"):
        Engine.from_pretrained(gemv)


def test_streaming_options_need_awq():
    with pytest.raises(InputError, match="needs an AWQ checkpoint"):
        Engine.from_pretrained(default_model_dir(), resident_layers=2)
