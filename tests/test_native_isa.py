"""The native step's instruction-set variants (native/build.py ISAS: avx512, avxvnni, avx2): each one
this CPU runs, other than the one the other native tests already cover (the best), forced and held
to the PyTorch reference and to batch invariance by the same tests; 8-bit codes at the extremes
(255 x 127 overflows the int16 pairs of AVX2's maddubs); the choice, forcing and refusal."""
from __future__ import annotations

import pytest
import torch

import test_native_decode
import test_native_packed
import test_native_rows
from kvboost_engine.model.arch import ModelAdapter
from kvboost_engine.native import build
from kvboost_engine.native.decoder import native_decoder
from test_native_decode import _contiguous, _paged
from test_native_packed import K8, Q4_1, Q8_0, packed_model

_BEST = build.candidates()[0][:1]          # the variant the other native tests run (none: no native step)
_CANNOT = None if _BEST else str(build.cpu_reason())


@pytest.fixture(params=list(build.ISAS))
def isa(request, monkeypatch):
    """Each variant this CPU runs but the best, forced through $KVBOOST_NATIVE_ISA."""
    if _CANNOT is not None or build.compiler() is None:
        pytest.skip(_CANNOT or "no C++ compiler")
    if [request.param] == _BEST:
        pytest.skip(f"{request.param} is the default: the other native tests run it")
    reason = build.isa_reason(request.param)
    if reason is not None:
        pytest.skip(reason)
    monkeypatch.setenv(build.ENV, request.param)
    return request.param


CASES, IDS = [], []
for _weights in ("float", "int4", "packed"):
    for (_type, _overrides), _id in zip(test_native_rows.ARCHS, test_native_rows.ARCH_IDS):
        CASES.append((_weights, _type, _overrides, _contiguous))
        IDS.append(f"{_weights}-{_id}-contiguous")
    CASES.append((_weights, "llama", {}, _paged))
    IDS.append(f"{_weights}-llama-paged")


@pytest.mark.parametrize("weights,model_type,overrides,kv_factory", CASES, ids=IDS)
def test_variant_batched_decode_is_bit_identical_to_serial_steps(isa, tmp_path, weights, model_type, overrides,
                                                                 kv_factory):
    test_native_rows.test_batched_decode_is_bit_identical_to_serial_steps(tmp_path, weights, model_type, overrides,
                                                                          kv_factory)


@pytest.mark.parametrize("weights,model_type,overrides,kv_factory", CASES, ids=IDS)
def test_variant_prefill_matches_pytorch_and_any_chunking(isa, tmp_path, weights, model_type, overrides, kv_factory):
    test_native_rows.test_native_prefill_matches_pytorch_and_any_chunking(tmp_path, weights, model_type, overrides,
                                                                          kv_factory)


@pytest.mark.parametrize("weights", ["float", "int4"])
def test_variant_rows_over_shared_key_blocks_match_serial_steps(isa, tmp_path, weights):
    arch = test_native_rows.ARCHS[0]
    test_native_rows.test_rows_over_shared_prefix_blocks_match_serial_steps(tmp_path, weights, *arch)
    test_native_rows.test_prompt_chunk_rows_over_a_whole_key_block_match_steps(tmp_path, weights, *arch)


@pytest.mark.parametrize("shape", list(test_native_rows.WIDER))
def test_variant_shared_tasks_at_wider_shapes_match_steps(isa, shape):
    test_native_rows.test_shared_tasks_at_wider_shapes_match_steps(shape, torch.float16)


@pytest.mark.parametrize("model_type,overrides", test_native_rows.ARCHS, ids=test_native_rows.ARCH_IDS)
def test_variant_int4_step_tracks_the_pytorch_step(isa, tmp_path, model_type, overrides):
    test_native_decode.test_native_step_tracks_the_pytorch_int4_step(tmp_path, model_type, overrides, _contiguous)


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", pytest.param("gemma3_text", marks=test_native_decode.no_gemma)])
def test_variant_float_step_equals_the_pytorch_step_up_to_rounding(isa, model_type):
    test_native_decode.test_float_native_step_equals_the_pytorch_step_up_to_rounding(_contiguous, model_type)


@pytest.mark.parametrize("formats,head", [([Q4_1], Q8_0), ([K8], Q8_0)], ids=["q4_1-q8_0", "k8-q8_0"])
def test_variant_packed_step_tracks_the_pytorch_step(isa, formats, head):
    test_native_packed.test_packed_model_decodes_natively_like_the_pytorch_path(formats, head, _contiguous)


def test_variant_k_quant_two_level_scales_are_exact(isa):
    test_native_packed.test_k_quant_two_level_scales_give_the_numbers_of_their_float32_products()


def test_variant_six_bit_codes_track_the_pytorch_path(isa):
    test_native_packed.test_six_bit_codes_decode_natively_like_the_pytorch_path(_paged)


def test_variant_numbers_do_not_depend_on_threads(isa, tmp_path):
    test_native_decode.test_a_step_gives_the_same_numbers_on_any_number_of_threads(tmp_path, "int4")


@pytest.mark.parametrize("variant", list(build.ISAS))
def test_extreme_8bit_codes_are_exact(variant, monkeypatch):
    """8-bit codes mostly 255 (and 0): in AVX2's u8 x s8 pair sums (maddubs) 255 * x0 + 255 * x1
    passes int16 as soon as x0 + x1 > 128; the step must still track the PyTorch path."""
    if _CANNOT is not None or build.compiler() is None or build.isa_reason(variant) is not None:
        pytest.skip(_CANNOT or build.isa_reason(variant) or "no C++ compiler")
    monkeypatch.setenv(build.ENV, variant)
    model = packed_model("llama", [K8], Q8_0)
    pick = torch.Generator().manual_seed(3)
    for module in model.modules():
        if getattr(module, "bits", None) == 8:
            extreme = torch.rand(module.codes.shape, generator=pick) < 0.85
            module.codes.copy_(torch.where(extreme, 255, 0).to(torch.uint8))
    pairs, decoder = test_native_packed._decode_both(model, _contiguous, steps=6)
    assert decoder.isa == variant
    for n, (want, got) in enumerate(pairs):
        error = ((got - want).norm() / want.norm()).item()
        assert error < 0.015, (variant, n, error)


@pytest.mark.parametrize("variant", list(build.ISAS))
def test_extreme_6bit_codes_are_exact(variant, monkeypatch):
    """6-bit codes mostly 63 (and 0): AVX2 adds two chunks' maddubs pairs in int16, 4 products of at
    most 63 x 128 (32,256 < 32,768); the step must still track the PyTorch path."""
    from tiny_models import tiny_model
    if _CANNOT is not None or build.compiler() is None or build.isa_reason(variant) is not None:
        pytest.skip(_CANNOT or build.isa_reason(variant) or "no C++ compiler")
    monkeypatch.setenv(build.ENV, variant)
    model = tiny_model("llama", seed=3, hidden_size=256, intermediate_size=512)
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    setattr(parent, name, test_native_packed.six_bit_linear(child))
    model.lm_head = test_native_packed.six_bit_linear(model.lm_head)
    pick = torch.Generator().manual_seed(3)
    for module in model.modules():
        if getattr(module, "bits", None) == 6:
            extreme = torch.rand(module.codes.shape, generator=pick) < 0.9
            module.codes.copy_(torch.where(extreme, 255, 0).to(torch.uint8))   # low nibbles 15, high bits 3
    pairs, decoder = test_native_packed._decode_both(model, _contiguous, steps=4)
    assert decoder.isa == variant
    for n, (want, got) in enumerate(pairs):
        error = ((got - want).norm() / want.norm()).item()
        assert error < 0.015, (variant, n, error)


def test_the_variant_runs_as_chosen_and_is_reported(monkeypatch, tmp_path):
    """The best variant by default; $KVBOOST_NATIVE_ISA forces one; one the CPU lacks, or an unknown
    name, is refused with the reason; the engine's stats() names the variant."""
    if _CANNOT is not None or build.compiler() is None:
        pytest.skip(_CANNOT or "no C++ compiler")
    model = packed_model("llama", [Q4_1], Q8_0)
    adapter = ModelAdapter(model)
    monkeypatch.delenv(build.ENV, raising=False)
    decoder, reason = native_decoder(adapter, threads=1)
    assert decoder is not None and [decoder.isa] == _BEST, reason
    for variant in build.ISAS:
        if build.isa_reason(variant) is None:
            monkeypatch.setenv(build.ENV, variant)
            decoder, reason = native_decoder(adapter, threads=1)
            assert decoder is not None and decoder.isa == variant, reason
    monkeypatch.setenv(build.ENV, "sse2")
    assert native_decoder(adapter)[0] is None and "not one of" in native_decoder(adapter)[1]
    monkeypatch.setattr(build, "cpu_flags", lambda: ({"avx2", "fma", "f16c"}, None))
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setenv(build.ENV, "avx512")
    decoder, reason = native_decoder(adapter)
    assert decoder is None and "avx512_vnni" in reason and "avx512" in reason
    monkeypatch.delenv(build.ENV)
    assert build.candidates() == (["avx2"], None)
    from kvboost_engine import Engine
    from kvboost_engine.loading import default_model_dir, load_model_and_tokenizer
    model, tokenizer = load_model_and_tokenizer(default_model_dir(), device=torch.device("cpu"), dtype=torch.float32)
    stats = Engine(model, tokenizer, cache_bytes=0).stats()
    assert stats["native_decode"] is True and stats["native_isa"] == "avx2"
    monkeypatch.setenv(build.ENV, "avx512")
    stats = Engine(model, tokenizer, cache_bytes=0).stats()
    assert stats["native_decode"] is False and "avx512_vnni" in stats["native_decode_off"]
