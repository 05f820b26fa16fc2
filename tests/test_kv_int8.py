"""KV kept in int8 (EngineConfig.kv_dtype="int8"): rows of int8 codes per block of 32 with a float16
scale each (kv/element.py); the native step (each instruction-set variant) reads and writes them as the
PyTorch path does; batched rows stay bit-identical to serial steps; exact reuse stays token-exact;
moved reuse rotates the stored keys; bad settings are an error. (Sizes, budgets and the disk tier:
test_kv_dtype.py, for every KV dtype.)"""
from __future__ import annotations

import pytest
import torch

from kvboost_engine import Engine, InputError
from kvboost_engine.config import EngineConfig
from kvboost_engine.kv.element import INT8_BLOCK, load, row_width, store
from kvboost_engine.kv.paged import PagedSequence
from kvboost_engine.model.arch import ModelAdapter
from kvboost_engine.native import build
from kvboost_engine.native.decoder import native_decoder
from test_engine_exact import replay
from test_kv_dtype import run_both
from test_moved_reuse import as_parts
from test_native_decode import PROMPT, _contiguous, _paged
from test_native_rows import SHARED_PROMPT, assert_rows_match_steps, make, shared_prefix_sequences

_CANNOT = build.cpu_reason() or (None if build.compiler() else "no C++ compiler")
needs_cpu = pytest.mark.skipif(_CANNOT is not None, reason=str(_CANNOT))
I8 = torch.int8
# head_dim 32 (one scale a row), 64 (two), 96 (a head size the kernels take by the generic path) and 512
# (wider than attend_heads takes: attend_wide)
HEADS = {"head32": {"num_attention_heads": 4, "num_key_value_heads": 2},
         "head64": {"num_attention_heads": 2, "num_key_value_heads": 1},
         "head96": {"head_dim": 96, "num_attention_heads": 4, "num_key_value_heads": 2},
         "head512": {"head_dim": 512, "num_attention_heads": 2, "num_key_value_heads": 1}}
WIDE_HEADS = {"head1088": {"head_dim": 1088, "num_attention_heads": 2, "num_key_value_heads": 1}}   # float queries


def _blocks_scale(rows: torch.Tensor) -> torch.Tensor:
    """The float16 scale of each block of 32 of stored int8 rows, repeated over its values."""
    head_dim = rows.shape[-1] * INT8_BLOCK // (INT8_BLOCK + 2)
    scales = rows[..., head_dim:].contiguous().view(torch.float16).float()
    return scales.repeat_interleave(INT8_BLOCK, dim=-1)


# ---- the format ----------------------------------------------------------------------------
def test_store_and_load_round_trip_within_half_a_step_and_store_again_the_same_bytes():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 64) * torch.tensor([0.01] * 32 + [40.0] * 32)      # blocks of very different size
    x[0, 0] = 0.0                                                           # an all-zero row
    rows = store(x, I8)
    assert rows.dtype == I8 and rows.shape == (3, 5, row_width(64, I8)) == (3, 5, 68)
    back = load(rows, torch.float32)
    assert back.shape == x.shape and torch.equal(back[0, 0], torch.zeros(64))
    assert ((back - x).abs() <= _blocks_scale(rows) / 2 + 1e-7).all()
    assert torch.equal(store(back, I8), rows)                               # well-formed rows: a fixed point
    assert (rows[..., :64].abs().amax(-1) == 127)[1:].all()                 # every non-zero block spans +-127


def test_codes_round_half_to_even_like_llama_q8_0():
    x = torch.zeros(32)
    x[:6] = torch.tensor([127.0, 2.5, 3.5, -2.5, 0.49, 126.5])             # amax 127: d = 1 exactly
    rows = store(x, I8)
    assert rows[:6].tolist() == [127, 2, 4, -2, 0, 126]
    assert rows[32:].view(torch.float16).item() == 1.0


def test_int8_kv_needs_a_head_dim_of_whole_blocks_and_no_second_disk_quantization(tmp_path):
    with pytest.raises(InputError, match="disk_kv_int8"):
        EngineConfig(kv_dtype="int8", disk_kv_int8=True, disk_cache_dir=str(tmp_path))
    model = make("float", "llama", {}, None)                                # head_dim 16
    with pytest.raises(InputError, match="multiple of 32"):
        ModelAdapter(model, I8)


# ---- the PyTorch path and the native step ----------------------------------------------------
def _native_vs_pytorch(weights, heads, kv_factory, tmp_path, steps=6):
    pairs, kv_torch, kv_native, _ = run_both(weights, I8, kv_factory, tmp_path, steps, {**HEADS, **WIDE_HEADS}[heads])
    end = len(PROMPT) + steps
    return pairs, [_rows(kv, end) for kv in (kv_torch, kv_native)]


@needs_cpu
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("kv_factory", [_contiguous, _paged], ids=["contiguous", "paged"])
@pytest.mark.parametrize("weights", ["float", "int4"])
def test_native_step_reads_and_writes_int8_kv_as_the_pytorch_path(tmp_path, weights, heads, kv_factory):
    """Native prefill and decode over int8 KV against the PyTorch path over int8 KV: the rows the native
    step writes are well-formed (store(load(rows)) == rows) and within one quantization step of the
    PyTorch path's (float weights: mostly the same codes; a K a float rounding apart can round to the
    neighbouring code); the logits agree to float tolerance (float weights: the keys scored against
    the float query, measured 3e-7 to 1e-4; int8 queries would give 4-6e-4) or the int8 rounding of
    activations (int4, whose step scores the keys against the query in int8 per block of 32)."""
    pairs, (want_rows, got_rows) = _native_vs_pytorch(weights, heads, kv_factory, tmp_path)
    tolerance = 3e-4 if weights == "float" else 0.05
    for n, (want, got) in enumerate(pairs):
        assert ((got - want).norm() / want.norm()) < tolerance, n
        if weights == "float":
            assert int(got.argmax()) == int(want.argmax())
    assert torch.equal(store(load(got_rows, torch.float32), I8), got_rows)
    want, got = load(want_rows, torch.float32), load(got_rows, torch.float32)
    if weights == "float":
        step = torch.maximum(_blocks_scale(want_rows), _blocks_scale(got_rows))
        assert ((got - want).abs() <= step * 1.01 + 1e-6).all()
        assert (got_rows == want_rows).float().mean() > 0.97
    else:
        assert ((got - want).norm() / want.norm()) < 0.05


@needs_cpu
@pytest.mark.parametrize("weights", ["float", "int4"])
def test_int8_queries_only_where_activations_are_int8_anyway(tmp_path, weights):
    """int4 (or packed) matrices take int8 activations, and over int8 KV the step then scores the keys
    against the query in int8 too (llama.cpp's q8_0 way); float weights keep float queries; stats()
    says which (native_int8_queries)."""
    from kvboost_engine.wiring import native_stats
    model = make(weights, "llama", HEADS["head64"], tmp_path)
    for kv_dtype, want in ((I8, weights == "int4"), (None, False)):
        decoder, reason = native_decoder(ModelAdapter(model, kv_dtype), threads=2)
        assert decoder is not None, reason
        assert decoder.int8_queries is want
        assert native_stats(decoder, None)["native_int8_queries"] is want


@needs_cpu
def test_int8_kv_heads_wider_than_int8_queries_keep_float_queries(tmp_path):
    """Heads wider than i8_scores takes (1,024) over int8 KV: the native step still runs them, with
    the keys scored against the float query (the same numbers in every kernel), also for int4."""
    wide = {"head_dim": 1088, "num_attention_heads": 2, "num_key_value_heads": 1}
    decoder, reason = native_decoder(ModelAdapter(make("int4", "llama", wide, tmp_path), I8), threads=2)
    assert decoder is not None, reason
    assert decoder.int8_queries is False
    pairs, _ = _native_vs_pytorch("int4", "head1088", _paged, tmp_path, steps=2)
    for want, got in pairs:
        assert ((got - want).norm() / want.norm()) < 0.05


@needs_cpu
@pytest.mark.parametrize("isa", list(build.ISAS))
@pytest.mark.parametrize("weights", ["float", "int4"])
def test_each_variant_reads_and_writes_int8_kv_alike(isa, weights, monkeypatch, tmp_path):
    """Each instruction-set variant, forced, against the PyTorch path: float weights score the keys
    against the float query; int4 against the query in int8 (i8_scores: vpdpbusd, or its vpmaddwd
    emulation on AVX2), in attend_heads, the generic path and attend_wide."""
    reason = build.isa_reason(isa)
    if reason is not None:
        pytest.skip(reason)
    monkeypatch.setenv(build.ENV, isa)
    for heads in ("head64", "head96", "head512"):             # whole vectors, the generic path, attend_wide
        pairs, (want_rows, got_rows) = _native_vs_pytorch(weights, heads, _paged, tmp_path, steps=3)
        for want, got in pairs:
            assert ((got - want).norm() / want.norm()) < (1e-3 if weights == "float" else 0.05)
        if weights == "float":
            assert (got_rows == want_rows).float().mean() > 0.97


@needs_cpu
def test_int8_query_scores_agree_across_variants(tmp_path, monkeypatch):
    """int4 weights over int8 KV (int8 queries): each variant with VNNI (vpdpbusd: AVX-512, AVX-VNNI)
    against AVX2's vpmaddwd emulation of i8_scores. The integer sums and their float steps are the same
    in every variant, and at these head sizes (the generic path, attend_wide) so is the rest of the
    step, so the logits agree to float rounding; the PyTorch comparison above (0.05: activations in
    int8) would pass a key scored with the wrong query codes (measured 0.02-0.04 from the PyTorch path,
    against 0.01-0.014)."""
    if build.isa_reason("avx2") is not None:
        pytest.skip(build.isa_reason("avx2"))
    others = [isa for isa in build.ISAS if isa != "avx2" and build.isa_reason(isa) is None]
    if not others:
        pytest.skip("no variant with VNNI runs on this CPU")

    def logits(model, isa):
        monkeypatch.setenv(build.ENV, isa)
        adapter = ModelAdapter(model, I8)
        decoder, reason = native_decoder(adapter, threads=2)
        assert decoder is not None and decoder.isa == isa and decoder.int8_queries, reason
        kv = _paged(adapter)
        with torch.inference_mode():
            out = [decoder.prefill(kv, PROMPT, 0)]
            out += [decoder(kv, token, len(PROMPT) + n) for n, token in enumerate(PROMPT[:3])]
        return out

    for heads in ("head96", "head512"):
        model = make("int4", "llama", HEADS[heads], tmp_path / heads)
        want = logits(model, "avx2")
        for isa in others:
            for w, got in zip(want, logits(model, isa)):
                assert ((got - w).norm() / w.norm()) < 1e-5, (heads, isa)


@needs_cpu
@pytest.mark.parametrize("isa", list(build.ISAS))
@pytest.mark.parametrize("weights", ["float", "int4"])
def test_batched_rows_over_int8_kv_match_serial_steps(tmp_path, weights, isa, monkeypatch):
    """Sequences over shared cached blocks (300 tokens: a whole key block and part of the next) and a
    sequence of its own decode in one step bit for bit as in steps of their own, logits and KV."""
    reason = build.isa_reason(isa)
    if reason is not None:
        pytest.skip(reason)
    monkeypatch.setenv(build.ENV, isa)
    model = make(weights, "llama", HEADS["head64"], tmp_path)
    adapter = ModelAdapter(model, I8)
    decoder, reason = native_decoder(adapter, threads=2)
    assert decoder is not None, reason
    tails = [[11, 12], [13, 14], [15], [16, 17, 18], [11, 12]]

    def sequences():
        out = shared_prefix_sequences(adapter, decoder, SHARED_PROMPT, tails)
        alone = PagedSequence(out[0].pool, 320)                 # nothing shared
        alone.reserve()
        decoder.prefill(alone, SHARED_PROMPT[:40], 0)
        return out + [alone]

    with torch.inference_mode():
        serial, batch = sequences(), sequences()
        positions = [300 + len(t) for t in tails] + [40]
        assert_rows_match_steps(decoder, serial, batch, positions)
    for a, b, p in zip(serial, batch, positions):
        assert torch.equal(_rows(a, p + 3), _rows(b, p + 3))


def _rows(kv, end: int) -> torch.Tensor:
    """The stored rows of positions 0..end of a sequence: [2, layers, kv_heads, end, row_width]."""
    ram, slots = kv.slot_view()
    return ram[:, :, :, slots[:end]]


# ---- the engine ----------------------------------------------------------------------------
@pytest.mark.parametrize("native", [False, "1", "0"], ids=["pytorch", "native", "native-decode"])
def test_multi_turn_reuse_is_token_exact_with_int8_kv(smol, native, monkeypatch):
    """A 3-turn chat with int8 KV: with and without cache, the same tokens; with prompt chunks and
    decode steps both native, the logits bit for bit (every path stores the same codes for the same
    values, and a cached turn's KV is the KV the same step would write); where a prefill's KV comes
    from PyTorch's products (the PyTorch path; native decode with float32 prompt chunks on PyTorch's
    MKL, the default on Intel CPUs) within 2 % (a key from a prefill's product and a decode step's, a
    float rounding apart, can take the neighbouring code: a whole step of up to 1/254 of its block's
    largest value; measured 0.3-0.6 %; 0.3-0.4 % on a Xeon with native decode)."""
    if native and _CANNOT is not None:
        pytest.skip(_CANNOT)
    if native:
        monkeypatch.setenv("KVBOOST_NATIVE_PREFILL", native)
    model, tokenizer = smol
    warm = replay(Engine(model, tokenizer, kv_dtype="int8", native_decode=bool(native), cache_bytes=256 << 20), turns=3)
    cold = replay(Engine(model, tokenizer, kv_dtype="int8", native_decode=bool(native), cache_bytes=0), turns=3)
    for turn, ((gw, lw, _), (gc, lc, _)) in enumerate(zip(warm, cold), 1):
        assert gw.token_ids == gc.token_ids, turn
        assert torch.equal(lw, lc) if native == "1" else float((lw - lc).norm() / lc.norm()) < 0.02, turn
        if turn >= 2:
            assert gw.reused_tokens > 0


def test_moved_reuse_rotates_int8_keys_as_values(smol):
    """Moved documents over int8 KV: their keys are read as values, rotated and stored again; the
    reply stays that of float32 KV on the same moved spans for its first tokens."""
    model, tokenizer = smol
    replies = {}
    for kv_dtype in (None, "int8"):
        engine = Engine(model, tokenizer, kv_dtype=kv_dtype, moved_reuse="blend")
        engine.chat(as_parts([0, 1, 2], "Which record mentions volcanoes?"), max_new_tokens=4)
        g = engine.chat(as_parts([2, 0, 1], "Which record mentions volcanoes?"), max_new_tokens=6)
        assert g.reused_moved > 100
        replies[kv_dtype] = g.token_ids
        engine.close()
    assert replies[None][:3] == replies["int8"][:3]


@pytest.mark.parametrize("native", [False, True], ids=["pytorch", "native"])
def test_concurrent_chats_over_int8_kv_give_the_tokens_each_gives_alone(smol, native):
    """Chats over one cached system prompt decode together (the PyTorch batch step reads the shared
    int8 blocks once per layer, the native step shares its attention tasks) with the replies each
    gives alone over int8 KV."""
    if native and _CANNOT is not None:
        pytest.skip(_CANNOT)
    from test_batching import QUESTIONS, chat, concurrent
    model, tokenizer = smol
    alone = Engine(model, tokenizer, kv_dtype="int8", native_decode=native, cache_bytes=0)
    want = [alone.chat(chat(q), max_new_tokens=10).token_ids for q in QUESTIONS[:4]]
    alone.close()
    engine = Engine(model, tokenizer, kv_dtype="int8", native_decode=native)
    engine.chat(chat(QUESTIONS[0]), max_new_tokens=1)                  # the system prompt is cached
    gens, batched = concurrent(engine, [(q, {}) for q in QUESTIONS[:4]], max_new_tokens=10)
    assert batched and [g.token_ids for g in gens] == want
    engine.close()
