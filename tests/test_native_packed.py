"""The native step over PackedLinear models (weights/packed.py: a quantized file's own codes and
scales, d in bf16 / fp16 / fp32 and m in fp16 / fp32): read in place, and the same numbers as the
PyTorch path (which dequantizes the same codes) up to the int8 rounding of the activations."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from kvboost_engine.model.arch import SUPPORTED_ARCHITECTURES, ModelAdapter
from kvboost_engine.model.forward import Forward
from kvboost_engine.native import build
from kvboost_engine.native.decoder import native_decoder, unsupported_reason, weights_kind
from kvboost_engine.weights.packed import BLOCK, PackedLinear, pack_codes
from test_native_decode import PROMPT, _contiguous, _paged, varied_qk_norms
from tiny_models import tiny_model

_CANNOT = build.cpu_reason() or (None if build.compiler() else "no C++ compiler")
needs_cpu = pytest.mark.skipif(_CANNOT is not None, reason=str(_CANNOT))


def packed_linear(linear: nn.Linear, bits: int, d_dtype: torch.dtype, m_dtype: torch.dtype) -> PackedLinear:
    """`linear` quantized per row and block of 32 (min/max, as Q4_1): codes, d and m in the given types."""
    w = linear.weight.detach().float()
    n, k = w.shape
    blocks = w.view(n, k // BLOCK, BLOCK)
    low, high = blocks.amin(-1), blocks.amax(-1)
    d = ((high - low) / (2 ** bits - 1)).clamp_min(1e-6).to(d_dtype).float()
    m = low.to(m_dtype).float()
    codes = ((blocks - m[..., None]) / d[..., None]).round().clamp(0, 2 ** bits - 1).to(torch.uint8).view(n, k)
    packed = pack_codes(codes, d, m, bits, d_dtype, m_dtype)
    return PackedLinear(packed["codes"], packed["d"], packed["m"], bits, n, k, linear.bias)


def packed_model(model_type: str, formats: list[tuple], head: tuple, seed: int = 4, **overrides):
    """A tiny model whose decoder linears take formats[i % len] (bits, d dtype, m dtype) in turn."""
    model = tiny_model(model_type, seed=seed, **overrides)
    n = 0
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, packed_linear(child, *formats[n % len(formats)]))
                    n += 1
    model.lm_head = packed_linear(model.lm_head, *head)
    return model


F16, F32, BF16 = torch.float16, torch.float32, torch.bfloat16
Q4_1 = (4, F16, F16)          # GGUF Q4_0 / Q4_1: fp16 d and m
Q8_0 = (8, F16, F16)
K4 = (4, F32, F32)            # K-quants: d * sub-block scale in fp32
K8 = (8, F32, F32)            # Q5_K / Q6_K as 8-bit codes
MIXED = [Q4_1, K4, K8, (4, BF16, F32), (8, BF16, F16), (4, F16, F32), (8, F32, F16)]


def _prefill_equals_steps(model, kv_factory) -> None:
    """A 40-token prompt prefilled natively in one chunk, in chunks, and token by token, bit for bit
    (test_native_rows.prefill_any_chunking; on 16-register variants a chunk of 16 rows or more reads
    6-bit codes expanded to bytes, a smaller one as stored)."""
    from test_native_rows import prefill_any_chunking
    adapter = ModelAdapter(model)
    decoder, reason = native_decoder(adapter, threads=2)
    assert decoder is not None, reason
    prefill_any_chunking(decoder, adapter, kv_factory, PROMPT + PROMPT[::-1])
    decoder.close()


def _decode_both(model, kv_factory, steps=10):
    adapter = ModelAdapter(model)
    forward = Forward(adapter)
    decoder, reason = native_decoder(adapter, threads=2)
    assert decoder is not None, reason
    kv_torch, kv_native = kv_factory(adapter), kv_factory(adapter)
    out = []
    with torch.inference_mode():
        forward(kv_torch, PROMPT, 0)
        forward(kv_native, PROMPT, 0)
        for n, token in enumerate(PROMPT[:steps]):
            position = len(PROMPT) + n
            out.append((forward(kv_torch, [token], position), decoder(kv_native, token, position)))
    return out, decoder


@needs_cpu
@pytest.mark.parametrize("formats,head", [([Q4_1], Q8_0), ([K4], K8), ([K8], Q8_0), (MIXED, (4, F16, F32))],
                         ids=["q4_1-q8_0", "k4-k8", "k8-q8_0", "mixed"])
@pytest.mark.parametrize("kv_factory", [_contiguous, _paged], ids=["contiguous", "paged"])
def test_packed_model_decodes_natively_like_the_pytorch_path(formats, head, kv_factory):
    model = packed_model("llama", formats, head)
    adapter = ModelAdapter(model)
    assert weights_kind(adapter) == "packed" and unsupported_reason(adapter) is None
    pairs, decoder = _decode_both(model, kv_factory)
    for n, (want, got) in enumerate(pairs):
        error = ((got - want).norm() / want.norm()).item()
        assert error < 0.015, (n, error)                     # int8 activations: 0.6-0.8 % here, any scale type
    # the decoder points at the modules' own tensors: no copy, no repack
    held = {t.data_ptr() for t in decoder._keep}
    for module in [*(m for i in range(len(adapter.layers)) for m in adapter.layer_parts(i).linears), model.lm_head]:
        assert {module.codes.data_ptr(), module.d.data_ptr(), module.m.data_ptr()} <= held


@needs_cpu
def test_packed_qwen2_biases_qwen3_qk_norms_gemma3_and_sliding_window():
    # Gemma 3 (transformers 5): 6 layers with two more norms each carry the int8 rounding further (2 %)
    gemma = [("gemma3_text", {}, 0.03)] if "gemma3_text" in SUPPORTED_ARCHITECTURES else []
    for model_type, overrides, limit in [("qwen2", {}, 0.015), ("qwen3", {}, 0.015), *gemma,
                                         ("mistral", {"sliding_window": 8}, 0.015)]:
        model = varied_qk_norms(packed_model(model_type, [Q4_1, K8], Q8_0, **overrides))
        for want, got in _decode_both(model, _contiguous)[0]:
            assert ((got - want).norm() / want.norm()).item() < limit, model_type


@needs_cpu
def test_packed_default_model_greedy_replies_equal_the_pytorch_path():
    """The default model packed (Q4_1-style layers, Q8_0 head; a tiny random model's logits are
    too flat for greedy comparisons): native and PyTorch engines give the same greedy tokens."""
    from kvboost_engine import Engine
    from kvboost_engine.loading import default_model_dir, load_model_and_tokenizer
    model, tokenizer = load_model_and_tokenizer(default_model_dir(), device=torch.device("cpu"), dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            for parent in (layer.self_attn, layer.mlp):
                for name, child in list(parent.named_children()):
                    if isinstance(child, nn.Linear):
                        setattr(parent, name, packed_linear(child, 4, F16, F16))
        model.lm_head = packed_linear(model.lm_head, 8, F16, F16)
        model.lm_head.exact_top = 8                     # the best logits recomputed in float (as Int8Linear)
    native, torch_loop = Engine(model, tokenizer, cache_bytes=0), Engine(model, tokenizer, cache_bytes=0,
                                                                         native_decode=False)
    assert native.stats()["native_decode"] is True
    chat = [{"role": "user", "content": "What color is the sky on a clear day?"}]
    # the native step rounds activations to int8 (the PyTorch path does not): replies agree for
    # their first 14 tokens here, then part on a near tie; 12 leaves a margin
    want, got = torch_loop.chat(chat, max_new_tokens=12).token_ids, native.chat(chat, max_new_tokens=12).token_ids
    assert got == want and len(got) == 12


def test_a_partly_packed_model_is_refused_with_a_reason():
    """A float32 head beside packed layers is read (AWQ keeps its head unquantized); a float decoder layer
    among packed ones is not."""
    model = packed_model("llama", [Q4_1], Q8_0)
    model.lm_head = nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=False)
    assert weights_kind(ModelAdapter(model)) == "packed"
    down = model.model.layers[0].mlp.down_proj
    model.model.layers[0].mlp.down_proj = nn.Linear(down.in_features, down.out_features, bias=False)
    assert weights_kind(ModelAdapter(model)) is None
    assert "PackedLinear" in unsupported_reason(ModelAdapter(model))


def symmetric_linear(linear: nn.Linear, bits: int, zero: int) -> PackedLinear:
    """`linear` quantized as Q4_0 / Q8_0 (code - zero) * d: m = -zero * d stored, zero_code given."""
    w = linear.weight.detach().float()
    n, k = w.shape
    blocks = w.view(n, k // BLOCK, BLOCK)
    d = (blocks.abs().amax(-1) / (zero - 1)).clamp_min(1e-6).half().float()
    codes = ((blocks / d[..., None]).round() + zero).clamp(0, 2 ** bits - 1).to(torch.uint8).view(n, k)
    packed = pack_codes(codes, d, -zero * d, bits, F16, F16)
    return PackedLinear(packed["codes"], packed["d"], packed["m"], bits, n, k, linear.bias, zero_code=zero)


def _native_logits(model, steps=6):
    adapter = ModelAdapter(model)
    decoder, reason = native_decoder(adapter, threads=2)
    assert decoder is not None, reason
    kv = _paged(adapter)
    with torch.inference_mode():
        Forward(adapter)(kv, PROMPT, 0)
        out = [decoder(kv, token, len(PROMPT) + n).clone() for n, token in enumerate(PROMPT[:steps])]
    decoder.close()
    return out


@needs_cpu
def test_a_derived_m_gives_the_numbers_of_the_stored_m():
    """Where m == -zero_code * d (Q4_0, Q8_0) the step reads d only and derives m: bit for bit the
    step that reads the stored m; and it stays close to the PyTorch path."""
    model = tiny_model("llama", seed=6)
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, symmetric_linear(child, 4, 8))
    model.lm_head = symmetric_linear(model.lm_head, 8, 128)
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    derived = _native_logits(model)
    for m in packed:
        m.zero_code = None
    stored = _native_logits(model)
    assert all(torch.equal(a, b) for a, b in zip(derived, stored))
    for want, got in _decode_both(model, _contiguous)[0]:
        assert ((got - want).norm() / want.norm()).item() < 0.015
    with pytest.raises(ValueError, match="power of two"):
        symmetric_linear(nn.Linear(32, 16), 4, 6)


@needs_cpu
def test_int4_layers_give_the_numbers_of_a_float32_offset(tmp_path, monkeypatch):
    """weights="int4": the step reads the bf16 zeros and computes code 0's value zero - 8 * scale (and
    the int8 head's -128 * scale): bit for bit the step over the float32 offsets stored."""
    from kvboost_engine.native import decoder as native, matrices
    from test_native_decode import int4_model

    model = int4_model("llama", tmp_path)
    derived = _native_logits(model)

    def stored_offsets(modules, bits):
        parts = [matrices._int4_parts(m) if bits == 4 else matrices._int8_parts(m) for m in modules]
        codes, scale = (torch.cat([p[i] for p in parts]) for i in range(2))
        offset = (torch.cat([p[2] for p in parts]).float() - 8 * scale.float()) if bits == 4 else -128 * scale.float()
        packed = pack_codes(codes, scale, offset, bits)
        packed["dims"] = (sum(m.out_features for m in modules), modules[0].in_features, bits)
        return packed

    monkeypatch.setattr(native, "joined", stored_offsets)
    stored = _native_logits(model)
    assert all(torch.equal(a, b) for a, b in zip(derived, stored))


@needs_cpu
@pytest.mark.parametrize("head,zero_code,native", [((8, F16, F16), None, True), ((4, BF16, F32), None, True),
                                                   ((4, F16, F16), 8, True), ((8, F32, F32), None, False)],
                         ids=["q8_0", "bf16-d", "derived-m", "f32-d"])
def test_a_tied_packed_embedding_is_decoded_natively_with_its_numbers(head, zero_code, native):
    """Where the embedding is the packed head's table (a tied GGUF or weights="int4"), the native side
    decodes the step's embeddings: the numbers PackedEmbedding gives; float32 d: the model's lookup."""
    from kvboost_engine.weights.packed import PackedEmbedding
    model = packed_model("llama", [Q4_1], head)
    if zero_code:                                   # m == -zero_code * d: the native side derives m
        h = model.lm_head
        model.lm_head = PackedLinear(h.codes, h.d, (-zero_code * h.d.float()).to(h.m.dtype), h.bits,
                                     h.out_features, h.in_features, zero_code=zero_code)
    model.model.embed_tokens = PackedEmbedding(model.lm_head)
    adapter = ModelAdapter(model)
    decoder, reason = native_decoder(adapter, threads=2)
    assert decoder is not None, reason
    assert decoder._embed_native is native
    ids = [0, 1, 15, 16, 17, model.lm_head.out_features - 1]
    with torch.inference_mode():
        assert torch.equal(decoder._embed(ids), adapter.embed(torch.tensor([ids]))[0].float())
        if native:                                  # an id past the table: refused natively, the lookup's own error
            with pytest.raises(IndexError):
                decoder._embed([model.lm_head.out_features])


def k_quant_linear(linear: nn.Linear, bits: int, two_level: bool = True, layout: int | None = None) -> PackedLinear:
    """`linear` quantized as Q4_K / Q5_K store it (`bits`-bit codes): per block of 32 a 6-bit scale and
    minimum, per super-block of 256 a float16 d and dmin (w = d * sc * code - dmin * mn). two_level:
    kept as stored (uint8 d and m, float16 d2 and m2); else as their float32 products. layout: the
    packed code width (default: 4-bit codes in 4, 5-bit in 6, as gguf_repack packs them)."""
    layout = layout or {4: 4, 5: 6}.get(bits, bits)
    from kvboost_engine.weights.packed import tile_scales
    w = linear.weight.detach().float()
    n, k = w.shape
    blocks = w.view(n, k // BLOCK, BLOCK)
    scale = (blocks.amax(-1) - blocks.amin(-1)) / (2 ** bits - 1)              # [N, B]
    low = (-blocks.amin(-1)).clamp_min(0)
    d = (scale.view(n, -1, 8).amax(-1) / 63).clamp_min(1e-4).half().float()     # [N, B / 8]
    dmin = (low.view(n, -1, 8).amax(-1) / 63).clamp_min(1e-4).half().float()
    sc = (scale / d.repeat_interleave(8, 1)).round().clamp(1, 63)
    mn = (low / dmin.repeat_interleave(8, 1)).round().clamp(0, 63)
    step, floor = d.repeat_interleave(8, 1) * sc, dmin.repeat_interleave(8, 1) * mn
    codes = ((blocks + floor[..., None]) / step[..., None]).round().clamp(0, 2 ** bits - 1).to(torch.uint8).view(n, k)
    if not two_level:
        packed = pack_codes(codes, step, -floor, layout, F32, F32)
        return PackedLinear(packed["codes"], packed["d"], packed["m"], layout, n, k, linear.bias)
    packed = pack_codes(codes, sc, mn, layout, torch.uint8, torch.uint8)
    return PackedLinear(packed["codes"], packed["d"], packed["m"], layout, n, k, linear.bias,
                        d2=tile_scales(d, F16), m2=tile_scales(-dmin, F16))


def _k_quant_model(two_level: bool, tied: bool = False, five: int = 6):
    """Layers alternately Q4_K and Q5_K (the 5-bit codes packed `five` bits wide), the head Q5_K."""
    model = tiny_model("llama", seed=9, hidden_size=256, intermediate_size=512, tie_word_embeddings=tied)
    for i, layer in enumerate(model.model.layers):
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, k_quant_linear(child, 4, two_level) if i % 2 == 0
                            else k_quant_linear(child, 5, two_level, five))
    model.lm_head = k_quant_linear(model.lm_head, 5, two_level, five)
    return model


@needs_cpu
def test_k_quant_two_level_scales_give_the_numbers_of_their_float32_products():
    """Q4_K / Q5_K kept with their two levels (uint8 sub-block scale and minimum, float16 super-block
    d and -dmin): the step multiplies them out exactly, bit for bit the step over float32 d and m
    (as packed before); the PyTorch path's weights are equal too; the tied embedding is decoded natively."""
    from kvboost_engine.weights.packed import PackedEmbedding
    two, flat = _k_quant_model(True), _k_quant_model(False)
    for a, b in zip([m for m in two.modules() if isinstance(m, PackedLinear)],
                    [m for m in flat.modules() if isinstance(m, PackedLinear)]):
        assert a.d.dtype == torch.uint8 and b.d.dtype == F32
        assert torch.equal(a.dequantized(), b.dequantized())
        assert torch.equal(a.dequantized(16, 48), b.dequantized(16, 48))
    assert weights_kind(ModelAdapter(two)) == "packed"
    native = _native_logits(two)
    assert all(torch.equal(x, y) for x, y in zip(native, _native_logits(flat)))
    # 5-bit codes in the 6-bit layout: the integer sums, so the numbers, of the 8-bit layout
    assert two.lm_head.bits == 6
    assert all(torch.equal(x, y) for x, y in zip(native, _native_logits(_k_quant_model(True, five=8))))
    for want, got in _decode_both(two, _paged)[0]:
        assert ((got - want).norm() / want.norm()).item() < 0.015
    _prefill_equals_steps(two, _paged)
    two.model.embed_tokens = PackedEmbedding(two.lm_head)
    decoder, reason = native_decoder(ModelAdapter(two), threads=2)
    assert decoder is not None and decoder._embed_native, reason
    ids = [0, 1, 15, 16, 17, two.lm_head.out_features - 1]
    with torch.inference_mode():
        assert torch.equal(decoder._embed(ids), PackedEmbedding(flat.lm_head)(torch.tensor([ids]))[0])
        one = two.model.embed_tokens(torch.tensor([[5]]))[0, 0]                # PackedEmbedding._one
        assert torch.equal(one, PackedEmbedding(flat.lm_head)(torch.tensor([5]))[0])
    decoder.close()
    with pytest.raises(ValueError, match="super-blocks"):
        a = two.lm_head
        PackedLinear(a.codes, a.d, a.m.half(), a.bits, a.out_features, a.in_features, d2=a.d2, m2=a.m2)


def six_bit_linear(linear: nn.Linear) -> PackedLinear:
    """`linear` quantized as Q6_K stores it: 6-bit codes, an int8 scale per 16 columns, a float16 d per
    256 (w = (code - 32) * d * sc)."""
    from kvboost_engine.weights.packed import tile_scales
    w = linear.weight.detach().float()
    n, k = w.shape
    groups = w.view(n, k // 16, 16)
    scale = groups.abs().amax(-1) / 31                                             # [N, G]
    d = (scale.view(n, -1, 16).amax(-1) / 127).clamp_min(1e-5).half().float()    # [N, K / 256]
    sc = (scale / d.repeat_interleave(16, 1)).round().clamp(-128, 127)
    sc = torch.where(torch.arange(sc.shape[1]) % 3 == 0, -sc, sc)                # negative scales too
    step = (d.repeat_interleave(16, 1) * sc)[..., None]
    codes = (groups / torch.where(step == 0, 1, step)).round().clamp(-32, 31) + 32
    packed = pack_codes(codes.to(torch.uint8).view(n, k), sc, None, 6, torch.int8)
    return PackedLinear(packed["codes"], packed["d"], None, 6, n, k, linear.bias, zero_code=32,
                        d2=tile_scales(d, F16))


@needs_cpu
@pytest.mark.parametrize("kv_factory", [_contiguous, _paged], ids=["contiguous", "paged"])
def test_six_bit_codes_decode_natively_like_the_pytorch_path(kv_factory):
    """6-bit codes (GGUF Q6_K: a scale per 16 columns, the step subtracting code 32's share in integers)
    beside 4- and 8-bit two-level K-quants: the step tracks the PyTorch path; a batched step gives
    each row's numbers bit for bit; the tied embedding decodes natively to PackedEmbedding's numbers."""
    from kvboost_engine.weights.packed import PackedEmbedding, unpack_codes
    from test_native_rows import assert_rows_match_steps
    model = tiny_model("qwen2", seed=11, hidden_size=256, intermediate_size=512, tie_word_embeddings=True)
    for i, layer in enumerate(model.model.layers):
        for parent in (layer.self_attn, layer.mlp):
            for n, (name, child) in enumerate(list(parent.named_children())):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, six_bit_linear(child) if (i + n) % 2 == 0 else k_quant_linear(child, 4))
    head = six_bit_linear(model.lm_head)
    codes = unpack_codes(head.codes, head.out_features, head.in_features, 6)
    assert int(codes.min()) == 0 and int(codes.max()) == 63                     # every high bit exercised
    model.lm_head = head
    model.model.embed_tokens = PackedEmbedding(head)
    pairs, decoder = _decode_both(model, kv_factory)
    for want, got in pairs:
        assert ((got - want).norm() / want.norm()).item() < 0.015
    assert decoder._embed_native
    ids = [0, 1, 15, 16, 17, head.out_features - 1]
    with torch.inference_mode():
        assert torch.equal(decoder._embed(ids), model.model.embed_tokens(torch.tensor([ids]))[0])
        adapter = ModelAdapter(model)
        lengths = [9, 4, 12]
        serial, batch = ([kv_factory(adapter) for _ in lengths] for _ in range(2))
        for kvs in (serial, batch):
            for kv, n in zip(kvs, lengths):
                decoder.prefill(kv, PROMPT[:n], 0)
        assert_rows_match_steps(decoder, serial, batch, lengths)
    decoder.close()
    _prefill_equals_steps(model, kv_factory)
