"""AutoAWQ's own on-disk format, checked without AutoAWQ installed.

Two sources: tests/data/autoawq-tiny-g64, written by AutoAWQ 0.2.9 itself (calibrated
quantization of a tiny random Llama, see benchmarks/fixtures/autoawq_tiny_fixture.py) with the logits
AutoAWQ computed from it; and a checkpoint this test packs by hand in AutoAWQ's layout from
integer weights it chose, next to the float model those integers dequantize to.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from kvboost_engine.weights.checkpoint import Checkpoint, read_header
from kvboost_engine.weights.awq.loader import load_awq_model
from kvboost_tools.awq.quantize import quantize_model, save_checkpoint

DATA = Path(__file__).parent / "data"
FIXTURE = DATA / "autoawq-tiny-g64"
CPU = torch.device("cpu")
# quantization_config exactly as AutoAWQ 0.2.9's save_quantized writes it
AUTOAWQ_QUANT = {"bits": 4, "group_size": 64, "modules_to_not_convert": None, "quant_method": "awq",
                 "version": "gemm", "zero_point": True}
# AutoAWQ GEMM: nibble i (bits 4i..4i+3) of word c holds column 8c + ORDER[i]
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def autoawq_pack(ints: np.ndarray) -> torch.Tensor:
    """[R, C] values 0..15 -> int32 [R, C/8] in AutoAWQ's GEMM order (written independently of format.py)."""
    words = np.zeros((ints.shape[0], ints.shape[1] // 8), dtype=np.uint32)
    for nibble, column in enumerate(ORDER):
        words |= ints[:, column::8].astype(np.uint32) << np.uint32(4 * nibble)
    return torch.from_numpy(words.view(np.int32).copy())


@pytest.mark.parametrize("kernel", ["dequant", "cpu-int4pack"])
def test_autoawq_written_checkpoint_gives_autoawq_logits(kernel):
    expected = load_file(str(DATA / "autoawq-tiny-g64-expected.safetensors"))
    model = load_awq_model(FIXTURE, device=CPU, dtype=torch.float32, kernel=kernel)
    with torch.no_grad():
        got = model(expected["input_ids"]).logits
    want = expected["logits"]                 # AutoAWQ's fp16 forward: allow its rounding
    assert (got - want).abs().max() < 0.01 * want.abs().max()


def test_autoawq_written_checkpoint_streams_identically():
    ids = load_file(str(DATA / "autoawq-tiny-g64-expected.safetensors"))["input_ids"]
    with torch.no_grad():
        resident = load_awq_model(FIXTURE, device=CPU, dtype=torch.float32)(ids).logits
        streamed_model = load_awq_model(FIXTURE, device=CPU, dtype=torch.float32, resident_layers=0, stream_from="ram")
        streamed = streamed_model(ids).logits
    assert streamed_model.kvboost_awq.streamed_layers == 2
    assert torch.equal(resident, streamed)


def test_our_producer_writes_autoawq_format(tmp_path):
    """Same config keys, tensor names, dtypes and shapes as AutoAWQ's own file for the same model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(FIXTURE)
    config.quantization_config = None
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    save_checkpoint(model, quantize_model(model, None, 64), tmp_path, 64)
    ours = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert ours == AUTOAWQ_QUANT == json.loads((FIXTURE / "config.json").read_text())["quantization_config"]
    layout = {n: (e.dtype, e.shape) for n, e in Checkpoint(tmp_path).entries.items()}
    assert layout == {n: (e.dtype, e.shape) for n, e in Checkpoint(FIXTURE).entries.items()}


def write_autoawq_layout(out: Path, group_size: int = 32, seed: int = 0) -> torch.nn.Module:
    """A tiny Llama as AutoAWQ lays it out on disk, from integer weights chosen here; returns the
    float model with exactly the dequantized weights (and the fp16-rounded dense tensors)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).half().float().eval()
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, linear in [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]:
        k, n = linear.in_features, linear.out_features
        q = rng.integers(0, 16, (k, n))
        zeros = rng.integers(0, 16, (k // group_size, n))
        scales = torch.from_numpy(rng.uniform(0.002, 0.02, (k // group_size, n))).half()
        tensors.update({f"{name}.qweight": autoawq_pack(q), f"{name}.qzeros": autoawq_pack(zeros),
                        f"{name}.scales": scales})
        weight = (torch.from_numpy(q - zeros.repeat(group_size, 0)).float()
                  * scales.float().repeat_interleave(group_size, 0))                 # [K, N]
        linear.weight.data = weight.T.contiguous()
    tensors.update({n: p.detach().half() for n, p in model.state_dict().items()
                    if ".layers." not in n or "layernorm" in n})
    tensors.pop("lm_head.weight")
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", "lm_head.weight": "model.embed_tokens.weight"})
    raw = {**config.to_dict(), "quantization_config": {**AUTOAWQ_QUANT, "group_size": group_size},
           "torch_dtype": "float16", "rope_theta": 10000.0, "transformers_version": "4.51.3", "use_cache": False}
    raw.pop("rope_parameters", None)
    raw.pop("dtype", None)
    (out / "config.json").write_text(json.dumps(raw))
    return model


def test_hand_packed_autoawq_layout_loads_exactly(tmp_path):
    reference = write_autoawq_layout(tmp_path / "ckpt")
    assert read_header(tmp_path / "ckpt" / "model.safetensors")[0]["__metadata__"]["format"] == "pt"
    model = load_awq_model(tmp_path / "ckpt", device=CPU, dtype=torch.float32, kernel="dequant")
    ids = torch.tensor([[5, 90, 17, 3, 64, 2, 33]])
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
