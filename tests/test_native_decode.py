"""The native decode step (kvboost_engine/native): the same step as the PyTorch int4 layer loop up
to the int8 rounding of activations, on every layout it takes; the engine uses it by default for
weights="int4" and falls back cleanly where it cannot run; the library is built once."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from kvboost_engine import Engine, InputError
from kvboost_engine.kv.contiguous import SequenceKV
from kvboost_engine.kv.paged import PagedSequence
from kvboost_engine.kv.pool import BlockPool
from kvboost_engine.model.arch import SUPPORTED_ARCHITECTURES, ModelAdapter
from kvboost_engine.model.forward import Forward
from kvboost_engine.native import build
from kvboost_engine.native.decoder import native_decoder, unsupported_reason
from kvboost_engine.weights.packed import pack_codes
from kvboost_engine.weights.quantized import convert_model
from tiny_models import tiny_model
from together import serial_and_together

# where the native step cannot run (no AVX512-VNNI, no C++ compiler) only the fallback tests run
_CANNOT = build.cpu_reason() or (None if build.compiler() else "no C++ compiler")
needs_cpu = pytest.mark.skipif(_CANNOT is not None, reason=str(_CANNOT))
no_gemma = pytest.mark.skipif("gemma3_text" not in SUPPORTED_ARCHITECTURES, reason="Gemma 3 needs transformers 5")
PROMPT = [5, 900, 17, 3000, 42, 7, 123, 4567, 89, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]


# k/v projections of 64 rows: PyTorch's int4 pack of fewer rows uses a layout we do not unpack
WIDE = dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=4)


def varied_qk_norms(model):
    """Qwen3's per-head q/k RMSNorm weights start at 1: randomised so a step that skips or misplaces them
    shows (Gemma 3's norms multiply by 1 + weight: tiny_model randomises them already)."""
    if model.config.model_type == "gemma3_text":
        return model
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                seeded = torch.Generator().manual_seed(len(name))
                param.copy_(torch.empty_like(param).uniform_(0.5, 1.5, generator=seeded))
    return model


def int4_model(model_type: str, tmp_path, **overrides):
    model = varied_qk_norms(tiny_model(model_type, seed=4, **{**WIDE, **overrides}))
    convert_model(model, "int4", cache_dir=tmp_path)
    return model


def test_pack_codes_layout():
    """Tiles of 16 rows x 32 columns: 4-bit codes as 4 x 64 bytes per tile block (byte 4r + i of
    group j: column 8j + i in the low nibble, 8j + 4 + i in the high one, row r), 8-bit as 8 x 64."""
    codes = torch.randint(0, 16, (32, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    scale, offset = torch.rand(32, 2).bfloat16(), torch.randn(32, 2)
    packed = pack_codes(codes, scale, offset, 4)
    tiles = packed["codes"].view(2, 2, 4, 64)                           # [tile, block, group, bytes]
    t, b, r, c = 1, 1, 5, 13                                            # row 21, column 45
    j, i = divmod(c, 8)
    byte = int(tiles[t, b, j, r * 4 + i % 4])
    assert (byte & 15 if i < 4 else byte >> 4) == codes[t * 16 + r, b * 32 + c]
    assert packed["d"].view(torch.bfloat16).view(2, 2, 16)[t, b, r] == scale[t * 16 + r, b]
    assert packed["m"].view(2, 2, 16)[t, b, r] == offset[t * 16 + r, b]
    wide = pack_codes(codes, scale, offset, 8)["codes"].view(2, 2, 8, 64)
    assert wide[t, b, c // 4, r * 4 + c % 4] == codes[t * 16 + r, b * 32 + c]


def _decode_both(model, kv_factory, steps=12):
    """Prefill PROMPT into two KVs, then decode the same tokens with PyTorch and native steps."""
    adapter = ModelAdapter(model)
    forward = Forward(adapter)
    decoder, reason = native_decoder(adapter, threads=2)
    assert decoder is not None, reason
    kv_torch, kv_native = kv_factory(adapter), kv_factory(adapter)
    with torch.inference_mode():
        forward(kv_torch, PROMPT, 0)
        forward(kv_native, PROMPT, 0)
        pairs = []
        for n, token in enumerate(PROMPT[:steps]):
            position = len(PROMPT) + n
            want, got = forward(kv_torch, [token], position), decoder(kv_native, token, position)
            pairs.append((want, got))
    return pairs, kv_torch, kv_native


def _contiguous(adapter):
    return SequenceKV(adapter.geometry, 64, adapter.device)


def _paged(adapter):
    pool = BlockPool(adapter.geometry, 64 * 1024 * 1024, adapter.device, block_tokens=4)
    sequence = PagedSequence(pool, 64)
    spare = pool.allocate(3)                        # so the sequence's blocks are not consecutive slots
    sequence.reserve()
    pool.release(spare)
    return sequence


@needs_cpu
@pytest.mark.parametrize("model_type,overrides", [
    ("llama", {}),
    ("qwen2", {}),                                           # q/k/v biases
    ("qwen3", {}),                                           # RMSNorm over each q / k head (head_dim 16)
    pytest.param("gemma3_text", {}, marks=no_gemma),
    # Gemma 3: (1 + w) norms, two more per layer, GELU, window 16 and global layers (2nd rotary), softcap
    ("mistral", {"sliding_window": 8}),                      # keys older than the window are not seen
    ("llama", {"hidden_size": 64, "head_dim": 32, "num_attention_heads": 4, "num_key_value_heads": 2}),
    # heads x head_dim != hidden size
])
@pytest.mark.parametrize("kv_factory", [_contiguous, _paged], ids=["contiguous", "paged"])
def test_native_step_tracks_the_pytorch_int4_step(tmp_path, model_type, overrides, kv_factory):
    model = int4_model(model_type, tmp_path, **overrides)
    pairs, kv_torch, kv_native = _decode_both(model, kv_factory)
    for n, (want, got) in enumerate(pairs):
        assert got.shape == want.shape and got.dtype == torch.float32
        error = ((got - want).norm() / want.norm()).item()
        assert error < 0.05, (n, error)                     # int8 activations: ~1 % here
    end = len(PROMPT) + len(pairs)
    positions = torch.arange(end)
    for layer in range(len(model.model.layers)):
        (k1, v1), (k2, v2) = kv_torch.gather(layer, positions), kv_native.gather(layer, positions)
        assert torch.equal(k1[..., :len(PROMPT), :], k2[..., :len(PROMPT), :])     # the prompt's KV untouched
        assert ((k2 - k1).norm() / k1.norm()) < 0.05 and ((v2 - v1).norm() / v1.norm()) < 0.05


@needs_cpu
@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", pytest.param("gemma3_text", marks=no_gemma)])
@pytest.mark.parametrize("kv_factory", [_contiguous, _paged], ids=["contiguous", "paged"])
def test_float_native_step_equals_the_pytorch_step_up_to_rounding(kv_factory, model_type):
    """Float32 weights: the same arithmetic in another order of additions."""
    model = varied_qk_norms(tiny_model(model_type, seed=5, **WIDE))
    pairs, kv_torch, kv_native = _decode_both(model, kv_factory)
    for n, (want, got) in enumerate(pairs):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (n, (got - want).abs().max())
        assert int(got.argmax()) == int(want.argmax())
    positions = torch.arange(len(PROMPT) + len(pairs))
    for layer in range(len(model.model.layers)):
        for want, got in zip(kv_torch.gather(layer, positions), kv_native.gather(layer, positions)):
            assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)


# Configurations real checkpoints of these families use that the tiny defaults leave out
VARIANTS = {
    # Gemma 3 4B and up: linear RoPE scaling (factor 8) on the global layers, none on the local ones
    "gemma3-linear-rope": ("gemma3_text", {"rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}}}),
    # attention_bias=True: biases on q, k, v and o (o's is the one no other tested model has)
    "qwen3-attention-bias": ("qwen3", {"attention_bias": True}),
    # head_dim 56: the q / k RMSNorms end in a partial vector (AVX-512: 32 in pairs of vectors, 16 in
    # one, 8 one by one), and the attention takes its generic path
    "qwen3-head56": ("qwen3", {"head_dim": 56}),
}


@needs_cpu
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_float_native_step_follows_scaled_rope_attention_biases_and_odd_heads(variant):
    """The native step against the PyTorch step where the rotary of some layers is scaled, the
    attention carries biases (set to random values: a model starts them at zero), or a head is no
    whole number of vectors."""
    model_type, overrides = VARIANTS[variant]
    if model_type not in SUPPORTED_ARCHITECTURES:
        pytest.skip(f"{model_type} needs transformers 5")
    model = varied_qk_norms(tiny_model(model_type, seed=5, **{**WIDE, **overrides}))
    biases = [m.bias for m in model.modules() if isinstance(m, torch.nn.Linear) and m.bias is not None]
    assert len(biases) == (4 * len(model.model.layers) if "bias" in variant else 0)
    with torch.no_grad():
        for bias in biases:
            bias.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(bias.numel()))
    pairs, _, _ = _decode_both(model, _contiguous)
    for n, (want, got) in enumerate(pairs):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (n, (got - want).abs().max())
        assert int(got.argmax()) == int(want.argmax())


@needs_cpu
@pytest.mark.parametrize("weights", ["int4", "float"])
def test_a_step_gives_the_same_numbers_on_any_number_of_threads(tmp_path, weights):
    """A step that starts while other decoders' steps run takes fewer threads (decode.cpp, Team), so
    its numbers must not depend on the split; 3 threads on this machine's 2 cores also meet at the
    barrier while one of them is descheduled."""
    model = int4_model("qwen2", tmp_path) if weights == "int4" else tiny_model("qwen2", seed=5, **WIDE)
    adapter = ModelAdapter(model)
    forward = Forward(adapter)
    runs = []
    for threads in (1, 2, 3):
        decoder, reason = native_decoder(adapter, threads=threads)
        assert decoder is not None, reason
        kv = _contiguous(adapter)
        with torch.inference_mode():
            forward(kv, PROMPT, 0)
            runs.append(torch.stack([decoder(kv, token, len(PROMPT) + n) for n, token in enumerate(PROMPT[:6])]))
        decoder.close()
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])


@needs_cpu
def test_engine_uses_it_by_default_and_off_on_request(tmp_path):
    model = int4_model("llama", tmp_path)           # the shared cache's library and default model (a home in
    # tmp_path built both again: 88 s of the suite)
    from transformers import AutoTokenizer
    from kvboost_engine.loading import default_model_dir
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    engine = Engine(model, tokenizer, cache_bytes=0)
    assert engine.stats()["native_decode"] is True
    reply = engine.generate("Hello there", max_new_tokens=6, min_new_tokens=6)
    assert len(reply.token_ids) == 6
    off = Engine(model, tokenizer, cache_bytes=0, native_decode=False)
    assert off.stats()["native_decode"] is False and "native_decode=False" in off.stats()["native_decode_off"]
    plain = tiny_model("llama")
    assert unsupported_reason(ModelAdapter(plain)) is None
    assert Engine(plain, tokenizer, cache_bytes=0).stats()["native_decode"] is True
    bf16 = tiny_model("llama")
    convert_model(bf16, "bf16", cache_dir=tmp_path)
    assert "float32" in unsupported_reason(ModelAdapter(bf16))
    with pytest.raises(InputError, match="int4"):
        Engine(bf16, tokenizer, cache_bytes=0, native_decode=True)
    with pytest.raises(InputError, match="native_decode"):
        Engine(plain, tokenizer, cache_bytes=0, native_decode="yes")
    phi3 = tiny_model("phi3")                                   # partial rotary: not plain Llama layers
    with pytest.raises(InputError, match="phi3"):
        Engine(phi3, tokenizer, cache_bytes=0, native_decode=True)


@needs_cpu
def test_int4_rows_the_step_cannot_read_say_so(tmp_path):
    """160 MLP rows (16 x 10, not a multiple of 64): PyTorch's pack layout for them is not one the step
    reads; the reason said the layers were not int4 and the head not int8, which they are."""
    model = tiny_model("llama", seed=0, hidden_size=192, num_attention_heads=6, num_key_value_heads=2,
                       intermediate_size=160, vocab_size=1008)
    convert_model(model, "int4", cache_dir=tmp_path)
    adapter = ModelAdapter(model)
    if all(m.block for m in adapter.layer_parts(0).linears):      # this CPU's layout reads them
        assert native_decoder(adapter)[0] is not None
        return
    reason = unsupported_reason(adapter)
    assert "int4 layer of 160 rows" in reason and "not int4" not in reason, reason


@needs_cpu
@no_gemma
def test_engine_runs_gemma3_natively_with_the_pytorch_loops_greedy_tokens():
    """Gemma 3 (window 16, global layers with their own base, soft-cap) takes the native step by
    default, and its greedy tokens past the window are those of the PyTorch layer loop."""
    from transformers import AutoTokenizer
    from kvboost_engine.loading import default_model_dir
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    model = tiny_model("gemma3_text", seed=5, **WIDE)
    native, loop = Engine(model, tokenizer, cache_bytes=0), Engine(model, tokenizer, cache_bytes=0, native_decode=False)
    assert native.stats()["native_decode"] is True and loop.stats()["native_decode"] is False
    prompt = "The archive keeps records of every hall, and each record names its hall. " * 2    # past the window
    replies = [e.generate(prompt, max_new_tokens=12, min_new_tokens=12) for e in (native, loop)]
    assert replies[0].prompt_tokens > 16 and replies[0].token_ids == replies[1].token_ids


def test_no_compiler_means_the_pytorch_path(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBOOST_HOME", str(tmp_path))
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setattr(build, "compiler", lambda: None)
    monkeypatch.setattr(build, "cpu_reason", lambda: None)
    lib, reason = build.load()
    assert lib is None and "compiler" in reason
    model = int4_model("llama", tmp_path)
    decoder, why = native_decoder(ModelAdapter(model))
    assert decoder is None and "compiler" in why
    from transformers import AutoTokenizer
    from kvboost_engine.loading import default_model_dir
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    engine = Engine(model, tokenizer, cache_bytes=0)
    assert engine.stats()["native_decode"] is False and "compiler" in engine.stats()["native_decode_off"]
    assert len(engine.generate("Hello", max_new_tokens=3, min_new_tokens=3).token_ids) == 3
    with pytest.raises(InputError, match="compiler"):
        Engine(model, tokenizer, cache_bytes=0, native_decode=True)


@needs_cpu
def test_float_default_reply_equals_the_pytorch_loop(smol):
    """The default model in float32 decodes natively by default and gives the same greedy replies
    as the PyTorch layer loop (native_decode=False), cold and over a cached prefix."""
    model, tokenizer = smol
    torch_loop = Engine(model, tokenizer, native_decode=False)
    native = Engine(model, tokenizer)
    assert native.stats()["native_decode"] is True
    chat = [{"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "What color is the sky on a clear day?"}]
    for _ in range(2):                                  # the second time over the cached prompt
        want = torch_loop.chat(chat, max_new_tokens=24)
        got = native.chat(chat, max_new_tokens=24)
        assert got.token_ids == want.token_ids
    assert got.reused_tokens > 0


@needs_cpu
@pytest.mark.parametrize("native_prefill", ["0", "1"])
def test_float_prompt_chunks_native_or_on_the_layer_loop(smol, monkeypatch, native_prefill):
    """Float32 prompt chunks run natively or on PyTorch's layer loop (MKL on Intel CPUs; forced here
    by $KVBOOST_NATIVE_PREFILL), decode stays native; stats() says which, and a reply over a cached
    prompt has the same tokens as cold either way."""
    from kvboost_engine.native import decoder as native_module
    model, tokenizer = smol
    monkeypatch.setenv(native_module.PREFILL_ENV, native_prefill)
    calls = []
    real = native_module.NativeDecoder.prefill
    monkeypatch.setattr(native_module.NativeDecoder, "prefill", lambda self, *a: calls.append(1) or real(self, *a))
    engine = Engine(model, tokenizer)
    stats = engine.stats()
    assert stats["native_decode"] is True and stats["native_prefill"] is (native_prefill == "1")
    assert ("native_prefill_off" in stats) is (native_prefill == "0")
    chat = [{"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "Name three colors."}]
    cold = Engine(model, tokenizer, cache_bytes=0).chat(chat, max_new_tokens=16, min_new_tokens=16)
    engine.chat(chat, max_new_tokens=16, min_new_tokens=16)
    warm = engine.chat(chat, max_new_tokens=16, min_new_tokens=16)
    assert warm.reused_tokens > 0 and warm.token_ids == cold.token_ids
    assert bool(calls) is (native_prefill == "1")


@needs_cpu
def test_an_interrupt_in_a_native_step_leaves_the_cache_consistent(smol, monkeypatch):
    from kvboost_engine.native.decoder import NativeDecoder
    model, tokenizer = smol
    engine, cold = Engine(model, tokenizer), Engine(model, tokenizer, cache_bytes=0)
    chat = [{"role": "user", "content": "List four bike parts."}]
    calls = {"n": 0}
    real = NativeDecoder.__call__

    def flaky(self, *args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt("simulated interrupt mid-decode")
        return real(self, *args)
    monkeypatch.setattr(NativeDecoder, "__call__", flaky)
    with pytest.raises(KeyboardInterrupt):
        engine.chat(chat, max_new_tokens=12)
    monkeypatch.setattr(NativeDecoder, "__call__", real)
    engine.cache.check_invariants()
    assert engine.chat(chat, max_new_tokens=12).token_ids == cold.chat(chat, max_new_tokens=12).token_ids


@needs_cpu
def test_library_is_built_once_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBOOST_HOME", str(tmp_path))
    monkeypatch.setattr(build, "_loaded", {})
    lib, reason = build.load()
    assert lib is not None, reason
    built = list((tmp_path / "native").glob("*.so"))
    assert len(built) == 1

    def no_build(*args):
        raise AssertionError("compiled again")
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setattr(build, "_compile", no_build)
    again, reason = build.load()
    assert again is not None, reason
    # the library's libgomp.so.1 is the one PyTorch loaded, not a second runtime (other wheels'
    # renamed copies, such as sentencepiece's libgomp-<hash>.so, are theirs)
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if line.rstrip().split("/")[-1].startswith("libgomp.so")}
    assert len(paths) <= 1, paths


@needs_cpu
def test_a_failed_build_is_a_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBOOST_HOME", str(tmp_path))
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setattr(build, "cpu_reason", lambda: None)
    monkeypatch.setattr(build, "FLAGS", build.FLAGS + ("-fno-such-flag-kvboost",))
    lib, reason = build.load()
    assert lib is None and "failed" in reason
    assert not list((tmp_path / "native").glob("*.so"))


def _copy_compile(calls: list):
    """A stand-in for build._compile: the library this process already built, copied (no compiler run)."""
    import shutil
    real, reason = build.load()
    assert real is not None, reason

    def copy(cxx, path, isa, source=build.SOURCE):
        calls.append(path.name)
        shutil.copyfile(real._name, path)
    return copy


def _aged(path, days: float) -> None:
    """`path` (created empty where absent) last modified `days` ago."""
    import os
    import time
    if not path.exists():
        path.write_bytes(b"")
    stamp = time.time() - days * 86400
    os.utime(path, (stamp, stamp))


@needs_cpu
def test_a_new_build_removes_libraries_unused_for_weeks(tmp_path, monkeypatch):
    """Building a library removes the others no process has loaded for STALE_DAYS (with their lock
    files), lock files as old without a library, and staging files a killed build left; it keeps
    newer ones and anything that is not the native build's."""
    calls: list = []
    monkeypatch.setattr(build, "_compile", _copy_compile(calls))
    monkeypatch.setenv("KVBOOST_HOME", str(tmp_path))
    monkeypatch.setattr(build, "_loaded", {})
    native = tmp_path / "native"
    native.mkdir()
    stale, recent = native / f"{build.PREFIX}avx2-00000000.so", native / f"{build.PREFIX}avx2-11111111.so"
    _aged(stale, build.STALE_DAYS + 1)
    _aged(native / f".{stale.name}.lock", build.STALE_DAYS + 1)
    _aged(recent, build.STALE_DAYS - 1)
    _aged(native / f".{recent.name}.lock", build.STALE_DAYS + 5)        # kept: its library is
    _aged(native / f".{build.PREFIX}avx2-22222222.so.lock", build.STALE_DAYS + 1)   # a failed build's
    _aged(native / f".{build.PREFIX}avx2-33333333.so.lock", 1)                     # newer: kept
    _aged(native / ".build-killed.so", 2)
    _aged(native / ".build-running.so", 0.01)
    _aged(native / "notes.txt", 400)
    lib, reason = build.load()
    assert lib is not None and len(calls) == 1, reason
    left = sorted(p.name for p in native.iterdir())
    assert left == sorted([calls[0], f".{calls[0]}.lock", recent.name, f".{recent.name}.lock",
                           f".{build.PREFIX}avx2-33333333.so.lock", ".build-running.so", "notes.txt"])


@needs_cpu
def test_a_load_marks_its_library_used_and_a_pruned_one_is_built_again(tmp_path, monkeypatch):
    """Each load sets its library's mtime, so a build in another process keeps it; a library removed
    between the check and the open (another process's prune) is built again, not a failure."""
    calls: list = []
    monkeypatch.setattr(build, "_compile", _copy_compile(calls))
    monkeypatch.setenv("KVBOOST_HOME", str(tmp_path))
    monkeypatch.setattr(build, "_loaded", {})
    lib, reason = build.load()
    assert lib is not None, reason
    path = tmp_path / "native" / calls[0]
    _aged(path, build.STALE_DAYS + 10)
    monkeypatch.setattr(build, "_loaded", {})
    assert build.load()[0] is not None and len(calls) == 1          # loaded as it was, not built
    assert build.prune(tmp_path / "native" / "another.so") == [] and path.exists()

    # a library this process has not opened (dlopen would reuse an open one by its path), found,
    # then removed by another process before the open
    import shutil
    other = tmp_path / "other" / "native"
    other.mkdir(parents=True)
    shutil.copyfile(path, other / path.name)
    real_mark = build._mark_used

    def pruned_meanwhile(p):
        real_mark(p)
        if len(calls) == 1:
            p.unlink()
    monkeypatch.setattr(build, "_mark_used", pruned_meanwhile)
    monkeypatch.setenv("KVBOOST_HOME", str(tmp_path / "other"))
    monkeypatch.setattr(build, "_loaded", {})
    lib, reason = build.load()
    assert lib is not None and reason is None and len(calls) == 2 and (other / path.name).exists()


@needs_cpu
def test_int4_requests_decoding_together_match_each_alone():
    """Up to batch_limit int4 sequences decoding together take one native step over all of them,
    each row's arithmetic that of its step alone: the same tokens as each request alone."""
    engine = Engine.from_pretrained(weights="int4", cache_bytes=0)
    assert engine.stats()["native_decode"] is True
    serial, together = serial_and_together(engine)
    assert together == serial
    assert engine.cache.pool.usage()["in_use"] == 0
    assert engine.stats()["native_fallback_steps"] == {}      # every step native, alone or together


def _library_in_a_new_home(home, monkeypatch, calls: list, content) -> tuple:
    """(this machine's loaded library, the path of its copy in `home`, a fresh $KVBOOST_HOME holding
    `content(its bytes)` there); builds into `calls` only copy the real one."""
    monkeypatch.setattr(build, "_compile", _copy_compile(calls))
    real, _ = build.load()
    monkeypatch.setenv("KVBOOST_HOME", str(home))
    monkeypatch.setattr(build, "_loaded", {})
    path = build.library_path(build.compiler(), real.isa)
    path.parent.mkdir(parents=True)
    path.write_bytes(content(Path(real._name).read_bytes()))
    return real, path


@needs_cpu
@pytest.mark.parametrize("keep", [0, 65536])
def test_a_library_cut_short_is_built_again_not_mapped(tmp_path, monkeypatch, keep):
    """A library left short at its name (a crash mid-write, a partial copy of the cache) is removed
    and built again: mapped, it killed the process (SIGBUS), or, empty, moved to the next variant."""
    calls: list = []
    real, path = _library_in_a_new_home(tmp_path, monkeypatch, calls, lambda whole: whole[:keep])
    assert not build._intact(path) and build._intact(Path(real._name))
    lib, reason = build.load(real.isa)
    assert lib is not None and lib.isa == real.isa and calls == [path.name], reason
    assert build._intact(path)


def _headers_overwritten(whole: bytes) -> bytes:
    return whole[:64] + bytes(224) + whole[64 + 224:]


@needs_cpu
def test_a_library_whole_in_length_but_damaged_is_built_again(tmp_path, monkeypatch):
    """Its program headers overwritten (its length as the header says): the loader refused it on every
    start and the native step was off for good (logged at INFO only), or a lesser variant ran."""
    calls: list = []
    real, path = _library_in_a_new_home(tmp_path, monkeypatch, calls, _headers_overwritten)
    assert build._intact(path)
    lib, reason = build.load(real.isa)
    assert lib is not None and lib.isa == real.isa and calls == [path.name], reason
    # in a cache this process cannot write (shared, read-only): a reason, not an exception out of Engine()
    _library_in_a_new_home(tmp_path / "ro", monkeypatch, calls, _headers_overwritten)
    monkeypatch.setattr(Path, "unlink", lambda self, missing_ok=False: (_ for _ in ()).throw(PermissionError(1, "ro")))
    lib, reason = build.load(real.isa)
    assert lib is None and "loading" in reason and len(calls) == 1


@needs_cpu
def test_a_compiler_that_cannot_run_is_a_reason(tmp_path, monkeypatch):
    """$CXX missing, or an executable that cannot run: a reason, not an exception out of Engine();
    $CXX with words after the compiler (a wrapper, flags) is used as a command line."""
    monkeypatch.setenv("KVBOOST_HOME", str(tmp_path))
    broken = tmp_path / "g++-broken"
    broken.write_text("#!/no/such/interpreter\n")
    broken.chmod(0o755)
    for cxx, why in [(str(tmp_path / "absent-g++"), "not found"), (str(broken), "failed")]:
        monkeypatch.setenv("CXX", cxx)
        monkeypatch.setattr(build, "_loaded", {})
        lib, reason = build.load()
        assert lib is None and why in reason, reason
    monkeypatch.setenv("CXX", "env g++")
    assert build.compiler().endswith("env g++")
    assert build.library_path(build.compiler(), "avx2").name.startswith(build.PREFIX)


@needs_cpu
def test_a_compile_past_its_time_stops_the_whole_compiler(tmp_path, monkeypatch):
    """The timeout killed g++'s driver alone: its cc1plus (gigabytes, seen under a sanitizer build)
    ran on beside the PyTorch fallback. A stand-in compiler whose work runs in a child process."""
    pid_file = tmp_path / "child.pid"
    fake = tmp_path / "slow-g++"
    fake.write_text(f'#!/bin/sh\ncase "$*" in *--version*) echo "slow 1"; exit 0;; esac\n'
                    f'sleep 120 &\necho $! > {pid_file}\nwait\n')
    fake.chmod(0o755)
    monkeypatch.setenv("KVBOOST_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.setenv(build.BUILD_TIMEOUT_ENV, "1")
    lib, reason = build.load_from(build.SOURCE, "avx2")
    assert lib is None and "timed out" in reason, reason
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:          # killed (gone, or a zombie not yet reaped)
        try:
            state = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            break
        if state == "Z":
            break
        time.sleep(0.05)
    else:
        os.kill(child, 9)
        raise AssertionError("the compiler's child process ran on after the timeout")
    for value in ("soon", "nan", "inf", "-1", "0"):          # nan / inf raised out of communicate()
        monkeypatch.setenv(build.BUILD_TIMEOUT_ENV, value)
        lib, reason = build.load_from(build.SOURCE, "avx2")
        assert lib is None and build.BUILD_TIMEOUT_ENV in reason, (value, reason)


@needs_cpu
def test_a_built_library_is_readable_by_others(tmp_path):
    """Not mkstemp's 0600 (kept by the linker): another user sharing $KVBOOST_HOME can load it."""
    source = tmp_path / "tiny.cpp"
    source.write_text('extern "C" int kvb_tiny() { return 1; }\n')
    path = tmp_path / "tiny.so"
    build._compile(build.compiler(), path, "avx2", source)
    assert path.stat().st_mode & 0o777 == 0o755 and build._intact(path)


@needs_cpu
def test_a_closed_decoder_refuses_to_step():
    model = tiny_model("llama")
    decoder, reason = native_decoder(ModelAdapter(model), threads=1)
    assert decoder is not None, reason
    kv = _contiguous(decoder.adapter)
    decoder.close()
    with pytest.raises(RuntimeError, match="closed"):
        decoder(kv, 1, 0)
