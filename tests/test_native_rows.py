"""The native step over several rows (decode.cpp kvb_decoder_rows): a batched decode step of M
sequences and a prompt chunk of one sequence. Each row's arithmetic is that of its step alone
(weight tiles read once for all rows, each row quantized and summed in the same order), so batched
decode gives bit-identical logits and KV to serial steps, and a prompt prefilled in any chunking
gives the same numbers as token-by-token steps; against the PyTorch path, float tolerance (fp32)
or the int8 rounding of activations (int4, packed)."""
from __future__ import annotations

import pytest
import torch

from kvboost_engine.kv.contiguous import SequenceKV
from kvboost_engine.model.arch import SUPPORTED_ARCHITECTURES, ModelAdapter
from kvboost_engine.model.forward import Forward
from kvboost_engine.native import build
from kvboost_engine.native.decoder import native_decoder
from test_native_decode import PROMPT, WIDE, _contiguous, _paged, int4_model, varied_qk_norms
from test_native_packed import K8, MIXED, packed_model
from tiny_models import tiny_model

_CANNOT = build.cpu_reason() or (None if build.compiler() else "no C++ compiler")
pytestmark = pytest.mark.skipif(_CANNOT is not None, reason=str(_CANNOT))

ARCHS = [("llama", {}), ("qwen2", {}), ("mistral", {"sliding_window": 8}),
         ("llama", {"hidden_size": 64, "head_dim": 32, "num_attention_heads": 4, "num_key_value_heads": 2}),
         ("qwen3", {}),
         # heads wider than attend_heads takes (decode.cpp attend_wide; Gemma's 256 on 8-float vectors):
         # 512 is wide on every variant; 3 query heads per KV head take a pass of two and one of one
         ("llama", {"hidden_size": 192, "head_dim": 512, "num_attention_heads": 3, "num_key_value_heads": 1})]
ARCH_IDS = ["llama", "qwen2", "mistral-window", "head_dim", "qwen3-qk-norms", "wide-head"]
if "gemma3_text" in SUPPORTED_ARCHITECTURES:      # transformers 5 only
    ARCHS.append(("gemma3_text", {}))
    ARCH_IDS.append("gemma3")


def make(weights: str, model_type: str, overrides: dict, tmp_path):
    if weights == "int4":
        return int4_model(model_type, tmp_path, **overrides)
    if weights == "packed":
        return varied_qk_norms(packed_model(model_type, MIXED, K8, **overrides))
    return varied_qk_norms(tiny_model(model_type, seed=5, **{**WIDE, **overrides}))


def _kv_state(kv, adapter, end):
    positions = torch.arange(end)
    return [t.clone() for layer in range(len(adapter.layers)) for t in kv.gather(layer, positions)]


def prefill_any_chunking(decoder, adapter, kv_factory, prompt: list[int]):
    """`prompt` prefilled natively in one chunk, in chunks of 5, 1, 23 and the rest, and token by token:
    asserts the last logits and the KV bit for bit the same; returns (logits, KV state)."""
    kv_whole, kv_chunks, kv_steps = (kv_factory(adapter) for _ in range(3))
    with torch.inference_mode():
        whole = decoder.prefill(kv_whole, prompt, 0)
        for lo, hi in ((0, 5), (5, 6), (6, 29), (29, len(prompt))):
            chunked = decoder.prefill(kv_chunks, prompt[lo:hi], lo)
        for p, t in enumerate(prompt):
            stepped = decoder(kv_steps, t, p)
    assert torch.equal(whole, chunked) and torch.equal(whole, stepped)
    states = [_kv_state(kv, adapter, len(prompt)) for kv in (kv_whole, kv_chunks, kv_steps)]
    assert all(torch.equal(x, y) for x, y in zip(states[0], states[1]))
    assert all(torch.equal(x, y) for x, y in zip(states[0], states[2]))
    return whole, states[0]


SHARED_PROMPT = [(7 * i + 3) % 900 + 5 for i in range(300)]      # a whole key block of 256 and part of the next


def shared_prefix_sequences(adapter, decoder, shared: list[int], tails: list[list[int]]) -> list:
    """Paged sequences over one pool, each mapping the cached blocks of `shared` (prefilled once) and
    then its own tail (prefilled), as chats over one cached system prompt are."""
    from kvboost_engine.kv.paged import PagedSequence
    from kvboost_engine.kv.pool import BlockPool
    pool = BlockPool(adapter.geometry, 64 * 1024 * 1024, adapter.device, block_tokens=4)
    base = PagedSequence(pool, len(shared) + 20)
    base.reserve()
    decoder.prefill(base, shared, 0)
    out = []
    for tail in tails:
        seq = PagedSequence(pool, len(shared) + 20)
        seq.map_shared(base.cache_blocks(0, len(shared)))
        seq.reserve()
        decoder.prefill(seq, tail, len(shared))
        out.append(seq)
    return out


def assert_rows_match_steps(decoder, serial: list, batch: list, positions: list[int], steps: int = 3) -> None:
    """`steps` tokens for each sequence: one step of its own over `serial`, one step of all rows over
    `batch` (the same sequences built again); the logits bit for bit."""
    for step in range(steps):
        tokens = [20 + i + step for i in range(len(positions))]
        want = [decoder(kv, t, p + step) for kv, t, p in zip(serial, tokens, positions)]
        got = decoder.decode_rows([(kv, t, p + step) for kv, t, p in zip(batch, tokens, positions)])
        for w, g in zip(want, got):
            assert torch.equal(w, g)


@pytest.mark.parametrize("weights", ["float", "int4", "packed"])
@pytest.mark.parametrize("model_type,overrides", ARCHS, ids=ARCH_IDS)
@pytest.mark.parametrize("kv_factory", [_contiguous, _paged], ids=["contiguous", "paged"])
def test_batched_decode_is_bit_identical_to_serial_steps(tmp_path, weights, model_type, overrides, kv_factory):
    model = make(weights, model_type, overrides, tmp_path)
    adapter = ModelAdapter(model)
    forward = Forward(adapter)
    decoder, reason = native_decoder(adapter, threads=2)
    assert decoder is not None, reason
    lengths = [20, 7, 13, 3, 16, 9, 11]                         # 7 rows: a block of 4 and one of 3
    serial_kvs, batch_kvs = [kv_factory(adapter) for _ in lengths], [kv_factory(adapter) for _ in lengths]
    with torch.inference_mode():
        for kvs in (serial_kvs, batch_kvs):
            for kv, n in zip(kvs, lengths):
                forward(kv, PROMPT[:n], 0)
        for step in range(3):
            tokens = [PROMPT[(i + step) % len(PROMPT)] for i in range(len(lengths))]
            want = [decoder(kv, t, n + step) for kv, t, n in zip(serial_kvs, tokens, lengths)]
            got = decoder.decode_rows([(kv, t, n + step) for kv, t, n in zip(batch_kvs, tokens, lengths)])
            for w, g in zip(want, got):
                assert torch.equal(w, g)
    for a, b, n in zip(serial_kvs, batch_kvs, lengths):
        assert all(torch.equal(x, y) for x, y in zip(_kv_state(a, adapter, n + 3), _kv_state(b, adapter, n + 3)))


@pytest.mark.parametrize("weights", ["float", "int4", "packed"])
@pytest.mark.parametrize("model_type,overrides", ARCHS, ids=ARCH_IDS)
@pytest.mark.parametrize("kv_factory", [_contiguous, _paged], ids=["contiguous", "paged"])
def test_native_prefill_matches_pytorch_and_any_chunking(tmp_path, weights, model_type, overrides, kv_factory):
    model = make(weights, model_type, overrides, tmp_path)
    adapter = ModelAdapter(model)
    forward = Forward(adapter)
    decoder, reason = native_decoder(adapter, threads=2)
    assert decoder is not None, reason
    prompt = PROMPT + PROMPT[::-1]                               # 40 tokens: past the mistral window
    kv_torch = kv_factory(adapter)
    with torch.inference_mode():
        want = forward(kv_torch, prompt[:12], 0)
        want = forward(kv_torch, prompt[12:], 12)               # a chunk over a prefix
    whole, native_state = prefill_any_chunking(decoder, adapter, kv_factory, prompt)
    states = [_kv_state(kv_torch, adapter, len(prompt)), native_state]
    if weights == "float":
        assert torch.allclose(whole, want, rtol=1e-4, atol=1e-4), (whole - want).abs().max()
        assert all(torch.allclose(x, y, rtol=1e-4, atol=1e-4) for x, y in zip(states[0], states[1]))
    else:                                                        # int8 activations
        assert ((whole - want).norm() / want.norm()).item() < 0.05
        assert all(((y - x).norm() / x.norm()).item() < 0.05 for x, y in zip(states[0], states[1]))


@pytest.mark.parametrize("weights", ["float", "int4"])
def test_forward_batch_takes_the_native_step_with_serial_numbers(tmp_path, weights):
    """Forward.batch with the native step: decoding sequences in one step, a prompt chunk in the
    same batch by native prefill; each sequence's logits equal to its own forward, bit for bit."""
    model = make(weights, "qwen2", {}, tmp_path)
    adapter = ModelAdapter(model)
    decoder, reason = native_decoder(adapter, threads=2)
    assert decoder is not None, reason
    forward = Forward(adapter, fast_decode=decoder)
    lengths = [20, 7, 13]
    alone, together = [_contiguous(adapter) for _ in lengths], [_contiguous(adapter) for _ in lengths]
    with torch.inference_mode():
        for kvs in (alone, together):
            for kv, n in zip(kvs, lengths):
                forward(kv, PROMPT[:n], 0)
        items = [(kv, [PROMPT[n - 1]], n) for kv, n in zip(alone[:2], lengths[:2])] + [(alone[2], PROMPT[:6], 13)]
        want = [forward(kv, ids, start) for kv, ids, start in items]
        items = [(kv, [PROMPT[n - 1]], n) for kv, n in zip(together[:2], lengths[:2])] + [(together[2], PROMPT[:6], 13)]
        got = forward.batch(items, [True, True, True])
    assert all(torch.equal(w, g) for w, g in zip(want, got))


@pytest.mark.parametrize("weights", ["float", "int4"])
def test_a_spilled_sequence_leaves_the_rest_of_the_step_native(tmp_path, weights):
    """A sequence whose KV blocks are spilled to disk cannot take the native step: it alone takes
    the layer loop (counted in Forward.fallbacks with its reason), and the sequences beside it keep
    the native step, so their numbers do not depend on who shares their step; more decoding
    sequences than batch_limit take several native steps, with the same numbers."""
    from kvboost_engine.kv.paged import PagedSequence
    from kvboost_engine.kv.pool import BlockPool
    model = make(weights, "llama", {}, tmp_path)
    adapter = ModelAdapter(model)
    decoder, reason = native_decoder(adapter, threads=2)
    assert decoder is not None, reason
    forward = Forward(adapter, fast_decode=decoder)
    g, block = adapter.geometry, 4
    pool = BlockPool(g, 12 * block * g.bytes_per_token, adapter.device, block_tokens=block,
                     spill_dir=str(tmp_path / "spill"), spill_bytes=64 * block * g.bytes_per_token)
    sequences = []
    for _ in range(4):
        sequence = PagedSequence(pool, 24)
        sequence.reserve()
        sequences.append(sequence)
    a, c, d, b = sequences                              # 12 blocks of RAM: a and c; d and b spill
    assert decoder.refusal(a, 16) is None and decoder.refusal(b, 16) == "KV blocks spilled to disk"
    with torch.inference_mode():
        for kv in sequences:
            forward(kv, PROMPT[:16], 0)
        before = dict(forward.fallbacks)
        b_alone = forward(b, [8], 16).clone()           # the layer loop
        with_c = [t.clone() for t in forward.batch([(a, [7], 16), (c, [8], 16)], [True, True])]
        with_b = [t.clone() for t in forward.batch([(a, [7], 16), (b, [8], 16), (d, [9], 16)], [True] * 3)]
        decoder.batch_limit = 1                          # a and c in two native steps
        split = forward.batch([(a, [7], 16), (c, [8], 16)], [True, True])
    assert torch.equal(with_c[0], with_b[0]) and torch.equal(with_b[1], b_alone)   # b beside d: as alone too
    assert all(torch.equal(x, y) for x, y in zip(with_c, split))
    spilled = forward.fallbacks["KV blocks spilled to disk"] - before.get("KV blocks spilled to disk", 0)
    assert spilled == 3                                  # b alone, b and d in the batch; a and c never
    decoder.prefill_off = "chunks on the layer loop by design (as float32 on Intel)"
    counted = dict(forward.fallbacks)
    with torch.inference_mode():
        forward.batch([(a, [7], 16), (b, PROMPT[:4], 17)], [True, True])
    assert forward.fallbacks == counted                  # a chunk the loop takes anyway is no fallback


@pytest.mark.parametrize("weights", ["float", "int4"])
def test_steps_keep_their_attention_partials_within_a_budget(tmp_path, monkeypatch, weights):
    """A step's attention partials grow with rows x context and stay allocated: past PARTIALS_BYTES a
    prompt chunk or a batch takes several steps (a row alone whatever its own), the same numbers."""
    from kvboost_engine.native import decoder as native
    model = make(weights, "llama", {}, tmp_path)
    adapter = ModelAdapter(model)
    decoder, reason = native_decoder(adapter, threads=2)
    assert decoder is not None, reason
    row_at_40 = decoder._partials(40)
    assert row_at_40 == adapter.config.num_attention_heads * adapter.geometry.head_dim * 4   # one key block
    sizes, step = [], decoder._step
    monkeypatch.setattr(decoder, "_step", lambda rows, ids: sizes.append(len(rows)) or step(rows, ids))
    kvs, prompt = [_contiguous(adapter) for _ in range(4)], (PROMPT * 2)[:40]
    with torch.inference_mode():
        whole = decoder.prefill(kvs[0], prompt, 0)
        together = decoder.decode_rows([(kvs[0], 7, 40), (kvs[1], 8, 0), (kvs[2], 9, 0)])
        monkeypatch.setattr(native, "PARTIALS_BYTES", 3 * row_at_40)
        assert decoder._split([5, 6, 7, 8, 9, 300, 301], 128) == [(0, 3), (3, 5), (5, 6), (6, 7)]
        sizes.clear()
        split = decoder.prefill(kvs[3], prompt, 0)
        assert sizes == [3] * 13 + [1]
        monkeypatch.setattr(native, "PARTIALS_BYTES", 2 * row_at_40)
        sizes.clear()
        apart = decoder.decode_rows([(kvs[3], 7, 40), (kvs[1], 8, 0), (kvs[2], 9, 0)])
        assert sizes == [2, 1]
    assert torch.equal(whole, split) and all(torch.equal(a, b) for a, b in zip(together, apart))
    assert all(torch.equal(a, b) for a, b in zip(_kv_state(kvs[0], adapter, 41), _kv_state(kvs[3], adapter, 41)))


def test_a_length_dependent_rotary_is_computed_per_chunk_and_per_sequence(monkeypatch):
    """longrope chooses its frequencies by a call's largest position (HF's dynamic update): the native
    prefill computes a chunk's cos / sin in one call over the chunk, as the PyTorch loop does (per
    row, the rows before original_max_position_embeddings took the short factors: another argmax),
    and the PyTorch loop over several sequences computes each sequence's as alone (not by the
    largest position of the whole batch)."""
    monkeypatch.setenv("KVBOOST_NATIVE_PREFILL", "1")            # float32 chunks natively on any CPU
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
            "long_factor": [8.0] * 8, "original_max_position_embeddings": 16}
    model = tiny_model("llama", seed=5, hidden_size=128, num_attention_heads=8, num_key_value_heads=4,
                       rope_parameters=rope)
    adapter = ModelAdapter(model)
    assert not adapter.static_rope
    decoder, reason = native_decoder(adapter, threads=2)
    assert decoder is not None and decoder.native_prefill, reason
    loop, native = Forward(adapter), Forward(adapter, fast_decode=decoder)
    prompt = (PROMPT * 2)[:24]                                   # past original_max_position_embeddings
    kvs = [_contiguous(adapter) for _ in range(4)]
    with torch.inference_mode():
        reference = model(torch.tensor([prompt])).logits[0, -1]
        by_loop, by_native = loop(kvs[0], prompt, 0), native(kvs[1], prompt, 0)
        short_alone = loop(kvs[2], prompt[:10], 0)
        loop(kvs[3], prompt[:20], 0)
        short_beside_long = loop.batch([(kvs[3], [prompt[20]], 20), (_contiguous(adapter), prompt[:10], 0)],
                                       [True, True])[1]
    assert torch.allclose(by_loop, reference, atol=1e-5) and torch.allclose(by_native, reference, atol=1e-4)
    assert by_native.argmax() == reference.argmax()
    assert torch.allclose(short_beside_long, short_alone, atol=1e-5)


@pytest.mark.parametrize("weights", ["float", "int4"])
@pytest.mark.parametrize("model_type,overrides", [ARCHS[0], ARCHS[3]], ids=[ARCH_IDS[0], ARCH_IDS[3]])
def test_rows_over_shared_prefix_blocks_match_serial_steps(tmp_path, weights, model_type, overrides):
    """Sequences mapping the same cached blocks (a shared prompt of 300 tokens: a whole key block of
    256 and part of the next) read those keys once in one attention task for all their rows; each row's
    logits and KV stay bit-identical to its own step, including rows at the same and at other positions."""
    model = make(weights, model_type, overrides, tmp_path)
    adapter = ModelAdapter(model)
    decoder, reason = native_decoder(adapter, threads=2)
    assert decoder is not None, reason
    tails = [[11, 12], [13, 14], [15], [16, 17, 18], [11, 12]]          # the first and last: same tokens
    with torch.inference_mode():
        serial, batch = (shared_prefix_sequences(adapter, decoder, SHARED_PROMPT, tails) for _ in range(2))
        positions = [300 + len(t) for t in tails]
        assert_rows_match_steps(decoder, serial, batch, positions)
    for a, b, p in zip(serial, batch, positions):
        assert all(torch.equal(x, y) for x, y in zip(_kv_state(a, adapter, p + 3), _kv_state(b, adapter, p + 3)))


CHUNK_PROMPT = [(11 * i + 5) % 900 + 3 for i in range(300)]


def _chunk_after_equals_steps(decoder, adapter, prefix: int) -> None:
    """CHUNK_PROMPT prefilled as `prefix` tokens and then one chunk of the rest gives the logits and KV
    of token-by-token steps, bit for bit."""
    kv_chunks, kv_steps = (SequenceKV(adapter.geometry, len(CHUNK_PROMPT) + 4, adapter.device) for _ in range(2))
    with torch.inference_mode():
        decoder.prefill(kv_chunks, CHUNK_PROMPT[:prefix], 0)
        chunked = decoder.prefill(kv_chunks, CHUNK_PROMPT[prefix:], prefix)
        for p, t in enumerate(CHUNK_PROMPT):
            stepped = decoder(kv_steps, t, p)
    assert torch.equal(chunked, stepped)
    end = len(CHUNK_PROMPT)
    assert all(torch.equal(x, y) for x, y in zip(_kv_state(kv_chunks, adapter, end), _kv_state(kv_steps, adapter, end)))


@pytest.mark.parametrize("weights", ["float", "int4"])
@pytest.mark.parametrize("model_type,overrides", [ARCHS[0], ARCHS[3]], ids=[ARCH_IDS[0], ARCH_IDS[3]])
def test_prompt_chunk_rows_over_a_whole_key_block_match_steps(tmp_path, weights, model_type, overrides):
    """The rows of one prompt chunk past a whole key block (here 20 rows after 280 tokens) read that
    block's keys once in shared tasks of up to 8 rows; logits and KV stay those of token-by-token steps."""
    model = make(weights, model_type, overrides, tmp_path)
    adapter = ModelAdapter(model)
    decoder, reason = native_decoder(adapter, threads=2)
    assert decoder is not None, reason
    _chunk_after_equals_steps(decoder, adapter, 280)


WIDER = {"gqa3-d64": {"hidden_size": 192, "head_dim": 64, "num_attention_heads": 6, "num_key_value_heads": 2},
         "group5": {"hidden_size": 160, "head_dim": 32, "num_attention_heads": 10, "num_key_value_heads": 2},
         "mha-d64": {"hidden_size": 128, "head_dim": 64, "num_attention_heads": 2, "num_key_value_heads": 2}}


@pytest.mark.parametrize("kv_dtype", [None, torch.float16], ids=["kv-model", "kv-f16"])
@pytest.mark.parametrize("shape", list(WIDER))
def test_shared_tasks_at_wider_shapes_match_steps(shape, kv_dtype):
    """Shared attention tasks where a KV head serves 3 query heads of 64 (one accumulator per head,
    the key columns held 4 lanes at a time), 5 of 32 (two head groups per KV head) and 1 of 64 (even
    and odd keys in two accumulators), float32 and float16 KV, with odd shared counts: a prompt chunk
    after 288 tokens (its rows share 33 and 41 keys of the second block) and sequences over a shared
    prompt of 301 tokens (45 of it), bit for bit token-by-token and serial steps. On AVX2 all three
    take shared_values' key tiles (their accumulators do not fit 16 registers); the one-row steps they
    are held to do not."""
    from kvboost_engine.kv.paged import PagedSequence
    from kvboost_engine.kv.pool import BlockPool
    model = tiny_model("llama", seed=5, **WIDER[shape])
    adapter = ModelAdapter(model, kv_dtype=kv_dtype)
    decoder, reason = native_decoder(adapter, threads=2)
    assert decoder is not None, reason
    prompt = CHUNK_PROMPT
    _chunk_after_equals_steps(decoder, adapter, 288)

    def sequences():
        pool = BlockPool(adapter.geometry, 64 * 1024 * 1024, adapter.device, block_tokens=1)
        base = PagedSequence(pool, 320)
        base.reserve()
        decoder.prefill(base, prompt + [7], 0)
        out = []
        for i in range(5):
            seq = PagedSequence(pool, 320)
            seq.map_shared(base.cache_blocks(0, 301))
            seq.reserve()
            decoder.prefill(seq, [20 + i] * (1 + i % 2), 301)
            out.append(seq)
        return out

    with torch.inference_mode():
        serial, batch = sequences(), sequences()
        positions = [301 + 1 + i % 2 for i in range(5)]
        for step in range(2):
            tokens = [30 + i + step for i in range(5)]
            want = [decoder(kv, t, p + step) for kv, t, p in zip(serial, tokens, positions)]
            got = decoder.decode_rows([(kv, t, p + step) for kv, t, p in zip(batch, tokens, positions)])
            assert all(torch.equal(w, g) for w, g in zip(want, got))


@pytest.mark.parametrize("weights", ["float", "int4"])
def test_kv_requests_ahead_on_or_off_give_the_same_numbers(tmp_path, monkeypatch, weights):
    """One-row attention asks for KV rows ahead or not by CPU (decoder.kv_ahead; $KVBOOST_NATIVE_KV_AHEAD
    decides here): prefetches only, so steps over a context of more than one key block give the same
    logits bit for bit either way."""
    from kvboost_engine.native import decoder as native_module
    from kvboost_engine.wiring import native_stats
    model = make(weights, "llama", {}, tmp_path)
    adapter = ModelAdapter(model)
    decoders = {}
    for ahead in ("1", "0"):
        monkeypatch.setenv(native_module.KV_AHEAD_ENV, ahead)
        decoders[ahead], reason = native_decoder(adapter, threads=2)
        assert decoders[ahead] is not None, reason
        assert decoders[ahead].kv_ahead is (ahead == "1")
        assert native_stats(decoders[ahead], None)["native_kv_ahead"] is (ahead == "1")     # stats() says which
    from kvboost_engine.kv.paged import PagedSequence
    from kvboost_engine.kv.pool import BlockPool
    pool = BlockPool(adapter.geometry, 64 * 1024 * 1024, adapter.device, block_tokens=4)
    kvs = {}
    for ahead in decoders:
        kvs[ahead] = PagedSequence(pool, len(SHARED_PROMPT) + 8)
        kvs[ahead].reserve()
    with torch.inference_mode():
        for ahead, kv in kvs.items():
            decoders[ahead].prefill(kv, SHARED_PROMPT, 0)
        for step in range(3):
            at = len(SHARED_PROMPT) + step
            on, off = (decoders[a](kvs[a], 20 + step, at) for a in ("1", "0"))
            assert torch.equal(on, off)
    n = len(SHARED_PROMPT) + 3
    assert all(torch.equal(a, b) for a, b in zip(_kv_state(kvs["1"], adapter, n), _kv_state(kvs["0"], adapter, n)))
