"""The default model (30 layers) as AWQ: streaming with 2 resident layers is token-identical, and on
the native step (the CPU default where it runs) reuse is token-exact.

Round-to-nearest quantization only (no calibration search) keeps this test to seconds; the
searched checkpoint's perplexity is measured by benchmarks/micro/awq_check.py.
"""
from __future__ import annotations

import copy

import pytest

from kvboost_engine import Engine
from kvboost_engine.native import build
from kvboost_tools.awq.quantize import quantize_model, save_checkpoint
from kvboost_engine.loading import default_model_dir


@pytest.fixture(scope="module")
def smol_awq(smol, tmp_path_factory):
    model = copy.deepcopy(smol[0])                   # quantize_model works in place; the session model stays
    path = tmp_path_factory.mktemp("awq") / "smol-awq-rtn"
    save_checkpoint(model, quantize_model(model, None, 64), path, 64, default_model_dir())
    return path


def test_streaming_2_of_30_token_identical(smol_awq):
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    resident = Engine.from_pretrained(smol_awq, cache_bytes=0, awq_kernel="cpu-int4pack").chat(messages, max_new_tokens=16)
    engine = Engine.from_pretrained(smol_awq, cache_bytes=0, resident_layers=2)
    streamed = engine.chat(messages, max_new_tokens=16)
    assert streamed.token_ids == resident.token_ids
    stats = engine.stats()
    assert (stats["resident_layers"], stats["streamed_layers"]) == (2, 28)
    assert stats["staging_bytes"] < 0.1 * (stats["resident_layer_bytes"] + stats["streamed_layer_bytes"])


@pytest.mark.skipif(not build.runs_here(), reason="the native step does not run on this machine")
def test_native_step_reuse_is_token_exact(smol_awq):
    """With cpu-int4pack (bf16 activations) a reply reusing 9 tokens differed from the cold one at its
    4th token (README); the native step computes each row the same whatever shares its forward."""
    engine = Engine.from_pretrained(smol_awq)
    stats = engine.stats()
    assert (stats["awq_kernel"], stats["native_decode"], stats["native_prefill"]) == ("native", True, True)
    system = {"role": "system", "content": "You answer questions about colours and light, briefly."}
    first = [system, {"role": "user", "content": "Why is the sky blue?"}]
    second = [system, {"role": "user", "content": "Name three colours of the rainbow."}]
    cold = Engine.from_pretrained(smol_awq, cache_bytes=0)
    for messages in (first, second, second):
        got = engine.chat(messages, max_new_tokens=24)
        assert got.token_ids == cold.chat(messages, max_new_tokens=24).token_ids
    assert engine.stats()["native_fallback_steps"] == {}
    assert got.reused_tokens > 0
