"""KV kept in float16 / bfloat16 (EngineConfig.kv_dtype): every path writes K and V rounded to
nearest even and computes with them as floats, the native step (each instruction-set variant) as the
PyTorch path does; exact reuse stays token-exact; the cache fingerprint and the disk tier keep KV
dtypes apart; bad values are an error."""
from __future__ import annotations

import pytest
import torch

from kvboost_engine import Engine, InputError
from kvboost_engine.config import EngineConfig
from kvboost_engine.model.arch import ModelAdapter
from kvboost_engine.model.forward import Forward
from kvboost_engine.native import build
from kvboost_engine.native.decoder import native_decoder
from test_engine_exact import replay
from test_native_decode import PROMPT, _contiguous, _paged
from test_native_rows import make

_CANNOT = build.cpu_reason() or (None if build.compiler() else "no C++ compiler")
needs_cpu = pytest.mark.skipif(_CANNOT is not None, reason=str(_CANNOT))
DTYPES = [torch.float16, torch.bfloat16]


def test_bad_kv_dtype_is_an_error():
    with pytest.raises(InputError, match="kv_dtype"):
        EngineConfig(kv_dtype="int4")
    with pytest.raises(InputError, match="kv_dtype"):
        EngineConfig(kv_dtype=torch.float16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kv_factory", [_contiguous, _paged], ids=["contiguous", "paged"])
def test_pytorch_path_keeps_kv_rounded(dtype, kv_factory):
    """The first layer's KV is its float32 K and V rounded to `dtype`; logits stay near float32 KV's."""
    model = make("float", "qwen2", {}, None)
    with torch.inference_mode():
        wide, narrow = ModelAdapter(model), ModelAdapter(model, dtype)
        kv32, kv16 = kv_factory(wide), kv_factory(narrow)
        a, b = Forward(wide)(kv32, PROMPT, 0), Forward(narrow)(kv16, PROMPT, 0)
        positions = torch.arange(len(PROMPT))
        for full, rounded in zip(kv32.gather(0, positions), kv16.gather(0, positions)):   # later layers see
            assert rounded.dtype == dtype and torch.equal(rounded, full.to(dtype))        # rounded attention
    assert int(a.argmax()) == int(b.argmax())
    assert ((a - b).norm() / a.norm()) < (0.01 if dtype == torch.float16 else 0.05)


def run_both(weights, dtype, kv_factory, tmp_path, steps=8, overrides=None):
    """The PROMPT prefilled, then `steps` decode steps, through the PyTorch path and the native step
    over KV of `dtype`: ([(PyTorch logits, native logits)], PyTorch's KV, the native step's KV, layers)."""
    model = make(weights, "llama", overrides or {}, tmp_path)
    adapter = ModelAdapter(model, dtype)
    forward = Forward(adapter)
    decoder, reason = native_decoder(adapter, threads=2)
    assert decoder is not None, reason
    kv_torch, kv_native = kv_factory(adapter), kv_factory(adapter)
    with torch.inference_mode():
        pairs = [(forward(kv_torch, PROMPT, 0), decoder.prefill(kv_native, PROMPT, 0))]
        for n, token in enumerate(PROMPT[:steps]):
            position = len(PROMPT) + n
            pairs.append((forward(kv_torch, [token], position), decoder(kv_native, token, position)))
    return pairs, kv_torch, kv_native, len(adapter.layers)


def _native_vs_pytorch(weights, dtype, kv_factory, tmp_path, steps=8):
    pairs, kv_torch, kv_native, layers = run_both(weights, dtype, kv_factory, tmp_path, steps)
    positions = torch.arange(len(PROMPT) + steps)
    kv = [(a, b) for layer in range(layers)
          for a, b in zip(kv_torch.gather(layer, positions), kv_native.gather(layer, positions))]
    return pairs, kv


@needs_cpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kv_factory", [_contiguous, _paged], ids=["contiguous", "paged"])
@pytest.mark.parametrize("weights", ["float", "int4"])
def test_native_step_reads_and_writes_kv_as_the_pytorch_path(tmp_path, weights, dtype, kv_factory):
    """Native prefill and decode over float16 / bfloat16 KV against the PyTorch path with the same
    KV dtype: the KV the two write agree to the KV's own rounding, the logits to float tolerance
    (float weights) or the int8 rounding of activations (int4)."""
    pairs, kv = _native_vs_pytorch(weights, dtype, kv_factory, tmp_path)
    tolerance = 1e-3 if weights == "float" else 0.05
    for n, (want, got) in enumerate(pairs):
        assert ((got - want).norm() / want.norm()) < tolerance, n
        if weights == "float":
            assert int(got.argmax()) == int(want.argmax())
    ulp = 2.0 ** -10 if dtype == torch.float16 else 2.0 ** -7
    for want, got in kv:
        assert got.dtype == dtype
        want, got = want.float(), got.float()
        if weights == "float":                                  # one rounding of nearly the same float:
            assert ((got - want).abs() <= want.abs() * ulp + 1e-3).all()
            assert (got == want).float().mean() > 0.97          # the same value but near a tie (truncating
                                                                # would differ in about half)
        else:
            assert ((got - want).norm() / want.norm()) < 0.05


@needs_cpu
@pytest.mark.parametrize("isa", list(build.ISAS))
def test_each_variant_rounds_kv_the_same(isa, monkeypatch, tmp_path):
    """Every variant this CPU runs writes the same float16 KV and logits over it (float weights:
    the order of additions differs by vector width, within float tolerance)."""
    reason = build.isa_reason(isa)
    if reason is not None:
        pytest.skip(reason)
    monkeypatch.setenv(build.ENV, isa)
    pairs, kv = _native_vs_pytorch("float", torch.float16, _paged, tmp_path, steps=4)
    for want, got in pairs:
        assert ((got - want).norm() / want.norm()) < 1e-3
    for want, got in kv:
        assert ((got.float() - want.float()).abs() <= want.float().abs() * 2.0 ** -10 + 1e-3).all()


@pytest.mark.parametrize("native, native_prefill", [(False, None), (True, "1"), (True, "0")],
                         ids=["pytorch", "native", "native-decode-only"])
def test_multi_turn_reuse_is_token_exact_with_float16_kv(smol, native, native_prefill, monkeypatch):
    """A 3-turn chat with float16 KV: with and without cache, the same tokens; the native step's
    logits bit for bit where it runs prompt chunks too (each row's arithmetic the same in prefill
    and decode), within 0.02 where prompt chunks take the PyTorch loop (the PyTorch path, and the
    native decode step with float32 prompt chunks on MKL, as on Intel CPUs): a key computed by a
    prefill's matrix product and by a decode step's can differ in the last float32 bit, and so
    round to neighbouring float16 values."""
    if native and _CANNOT is not None:
        pytest.skip(_CANNOT)
    if native_prefill is not None:
        monkeypatch.setenv("KVBOOST_NATIVE_PREFILL", native_prefill)
    exact = native_prefill == "1"
    model, tokenizer = smol
    warm = replay(Engine(model, tokenizer, kv_dtype="float16", native_decode=native, cache_bytes=256 << 20), turns=3)
    cold = replay(Engine(model, tokenizer, kv_dtype="float16", native_decode=native, cache_bytes=0), turns=3)
    for turn, ((gw, lw, _), (gc, lc, _)) in enumerate(zip(warm, cold), 1):
        assert gw.token_ids == gc.token_ids, turn
        assert torch.equal(lw, lc) if exact else torch.allclose(lw, lc, atol=0.02, rtol=0), turn
        if turn >= 2:
            assert gw.reused_tokens > 0


@pytest.mark.parametrize("kv_dtype, bytes_of_64", [("float16", 128), ("int8", 68)])
def test_kv_dtype_is_reported_shrinks_kv_and_keeps_disk_entries_apart(smol, tmp_path, kv_dtype, bytes_of_64):
    """stats() names the KV dtype; a row of 64 values takes 128 bytes in float16, 68 in int8 (its codes
    and two float16 scales) against float32's 256, and the same kv_pool_bytes hold as many more tokens;
    the disk tier serves the stored rows to an engine of the same KV dtype after a restart, never to a
    float32 one."""
    model, tokenizer = smol
    messages = [{"role": "system", "content": "You are a terse assistant. " * 20},
                {"role": "user", "content": "Name a colour."}]
    kw = dict(cache_bytes=64 << 20, kv_pool_bytes=128 << 20, disk_cache_dir=str(tmp_path), native_decode=False)
    first = Engine(model, tokenizer, kv_dtype=kv_dtype, **kw)
    assert first.stats()["kv_dtype"] == kv_dtype
    wide = Engine(model, tokenizer, **kw)
    assert wide.stats()["kv_dtype"] == "float32"
    assert first.fingerprint != wide.fingerprint
    assert first.adapter.geometry.bytes_per_token * 256 == wide.adapter.geometry.bytes_per_token * bytes_of_64
    assert first.stats()["pool_ram_blocks"] == wide.stats()["pool_ram_blocks"] * 256 // bytes_of_64
    want = first.chat(messages, max_new_tokens=8)
    first.close()
    wide.close()
    again = Engine(model, tokenizer, kv_dtype=kv_dtype, **kw)
    got = again.chat(messages, max_new_tokens=8)
    assert got.token_ids == want.token_ids and got.reused_tokens > 0 and again.stats()["disk_hits"] > 0
    again.close()
    other = Engine(model, tokenizer, **kw)
    assert other.chat(messages, max_new_tokens=8).reused_tokens == 0
    other.close()
