"""A GGUF loaded as stored (weights/gguf_model.py): tiny random llama / qwen2 / qwen3 / gemma3 files
written with the `gguf` package. The packed model's PyTorch forward equals transformers' own
dequantized model of the same file (exact types: bit for bit; re-quantized types: within the
stated error); a cached reload reads no GGUF; bad input is refused before anything is built."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGUFReader, quants

from kvboost_engine import Engine
from kvboost_engine.errors import InputError
from kvboost_engine.loading import converted_gguf_dir, load_model_and_tokenizer, resolve_model_dir
from kvboost_engine.native import build
from kvboost_engine.weights import gguf_model
from kvboost_engine.weights.gguf_file import GGUFFile
from kvboost_engine.weights.gguf_model import load_packed_model, packed_gguf_dir
from kvboost_engine.model.arch import SUPPORTED_ARCHITECTURES
from kvboost_engine.weights.gguf_repack import repack, zero_code
from kvboost_engine.weights.packed import PackedEmbedding, PackedLinear

from gguf_models import Q, native_tracks_torch, write_model

CPU, F32 = torch.device("cpu"), torch.float32
_NATIVE_CANNOT = build.cpu_reason() or (None if build.compiler() else "no C++ compiler")
IDS = torch.tensor([[256, 72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, 257, 200]])


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBOOST_HOME", str(tmp_path / "home"))


def _both(path):
    packed, _ = load_model_and_tokenizer(packed_gguf_dir(path), device=CPU, dtype=F32)
    floats, _ = load_model_and_tokenizer(converted_gguf_dir(path), device=CPU, dtype=F32)
    with torch.inference_mode():
        return packed, packed(IDS).logits, floats(IDS).logits


@pytest.mark.parametrize("arch,qtype", [("llama", Q.Q4_0), ("llama", Q.Q4_1), ("qwen2", Q.Q8_0), ("qwen3", Q.Q5_0),
                                        ("gemma3", Q.Q4_1), ("llama", Q.Q5_1)], ids=str)
def test_packed_model_equals_transformers_dequantized(tmp_path, arch, qtype):
    path = tmp_path / f"{arch}.gguf"
    write_model(path, arch, qtype, embed=Q.Q8_0, bias=arch == "qwen2")
    packed, ours, reference = _both(path)
    linears = [m for m in packed.modules() if isinstance(m, PackedLinear)]
    assert len(linears) == 2 * 7 + 1 and isinstance(packed.model.embed_tokens, PackedEmbedding)
    assert packed.lm_head is packed.model.embed_tokens.table                    # tied: one table
    assert not any(p.is_meta for p in packed.parameters())
    assert torch.equal(ours, reference)


def test_a_qwen3_head_dim_other_than_128_is_read(tmp_path, monkeypatch):
    """transformers' GGUF reader drops Qwen3's attention.key_length and keeps Qwen3Config's 128:
    another head_dim failed to load (a raw RuntimeError on the float32 path)."""
    import gguf_models
    monkeypatch.setitem(gguf_models.HEAD_DIM, "qwen3", 32)
    path = tmp_path / "q.gguf"
    write_model(path, "qwen3", Q.Q4_0, embed=Q.Q8_0)
    packed, ours, reference = _both(path)
    assert packed.config.head_dim == 32
    assert torch.equal(ours, reference)


def test_untied_head_and_k_quants(tmp_path):
    path = tmp_path / "k.gguf"
    write_model(path, "llama", Q.Q4_K, head=Q.Q5_K, embed=Q.Q8_0, tied=False)
    packed, ours, reference = _both(path)
    assert packed.lm_head is not packed.model.embed_tokens.table
    assert packed.lm_head.bits == 6 and packed.lm_head.d.dtype == torch.uint8 and packed.lm_head.d2.dtype == torch.float16
    assert torch.equal(ours, reference)


def test_q6_k_is_kept_exact_in_six_bits(tmp_path):
    """Q6_K keeps its 6-bit codes, int8 scales per 16 and fp16 super-block scale (6.56 bits a weight,
    as the file): every weight is gguf's own (code - 32) * (d * sc), the model's forward equals the
    float conversion's bit for bit, and the native step tracks the PyTorch loop over the codes."""
    path = tmp_path / "q6.gguf"
    write_model(path, "llama", Q.Q6_K, head=Q.Q6_K, embed=Q.Q6_K, tied=False)
    tensor = GGUFFile(path).tensors["output.weight"]
    packed = repack(tensor)
    assert (packed.bits, packed.max_error, packed.m, packed.d.dtype, packed.d2.dtype) == (6, 0.0, None, torch.int8,
                                                                                             torch.float16)
    assert packed.codes.numel() + packed.d.numel() + 2 * packed.d2.numel() == tensor.nbytes
    reference = torch.from_numpy(quants.dequantize(tensor.raw, Q.Q6_K).reshape(tensor.shape).astype(np.float32))
    linear = PackedLinear(packed.codes, packed.d, None, 6, *tensor.shape, zero_code=32, d2=packed.d2)
    assert torch.equal(linear.dequantized(), reference)
    assert torch.equal(linear.dequantized(16, 64), reference[16:64])
    rows = torch.tensor([0, 5, 17, 271])
    assert torch.equal(PackedEmbedding(linear)(rows), reference[rows])
    assert torch.equal(PackedEmbedding(linear)(torch.tensor(17)), reference[17])
    model, ours, float_logits = _both(path)
    assert torch.equal(ours, float_logits)
    assert model.kvboost_packed["requantized_error"] == {}
    if not build.cpu_reason() and build.compiler():
        native_tracks_torch(model, [256] + [72, 101, 108, 108, 111, 32] * 20, steps=4, capacity=256)


def test_dequantized_weights_equal_the_gguf_package(tmp_path):
    path = tmp_path / "w.gguf"
    write_model(path, "llama", Q.Q4_0, embed=Q.Q8_0)
    file = GGUFFile(path)
    for t in GGUFReader(path).tensors:
        if len(t.shape) != 2 or t.tensor_type not in (Q.Q4_0, Q.Q8_0):
            continue
        packed = repack(file.tensors[t.name])
        ours = PackedLinear(packed.codes, packed.d, packed.m, packed.bits, packed.rows, packed.cols,
                            zero_code=zero_code(t.tensor_type.name)).dequantized()
        reference = torch.from_numpy(np.array(quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
        assert torch.equal(ours, reference.view(ours.shape)), t.name          # +0.0 == -0.0 as numbers


def test_cached_reload_reads_no_gguf_and_maps_the_weights(tmp_path, monkeypatch):
    path = tmp_path / "m.gguf"
    write_model(path, "llama", Q.Q4_1, embed=Q.Q8_0)
    target = packed_gguf_dir(path)
    monkeypatch.setattr(gguf_model, "_build", lambda *a: pytest.fail("repacked again"))
    assert packed_gguf_dir(path) == target
    monkeypatch.setattr(gguf_model, "GGUFFile", lambda *a: pytest.fail("read the GGUF"))
    from transformers import AutoConfig
    model = load_packed_model(target, AutoConfig.from_pretrained(target))
    info = model.kvboost_packed
    size = (target / gguf_model.DATA).stat().st_size
    assert 0.9 * size <= info["mapped_bytes"] <= size
    # views of the mapping, not copies
    (start, end), = model.kvboost_mapped
    assert end - start == size
    for tensor in (model.model.layers[0].mlp.down_proj.codes, model.lm_head.d, model.model.norm.weight):
        assert start <= tensor.data_ptr() < end


def test_a_new_pack_removes_the_superseded_packs_of_its_file(tmp_path, monkeypatch):
    path, other = tmp_path / "m.gguf", tmp_path / "o.gguf"
    write_model(path, "llama", Q.Q4_1, embed=Q.Q8_0)
    write_model(other, "llama", Q.Q4_1, embed=Q.Q8_0)
    current = gguf_model.PACK_VERSION
    monkeypatch.setattr(gguf_model, "PACK_VERSION", "gguf-pack-old")
    old, kept = packed_gguf_dir(path), packed_gguf_dir(other)
    monkeypatch.setattr(gguf_model, "PACK_VERSION", current)
    new = packed_gguf_dir(path)                        # a new pack version: packed again
    assert new != old and gguf_model.is_packed_dir(new)
    assert not old.exists() and gguf_model.is_packed_dir(kept)       # another file's pack stays
    os.utime(path, ns=(1, 1))                            # the file changed: its pack is rebuilt, the old one goes
    assert packed_gguf_dir(path) != new and not new.exists()


def test_a_new_conversion_removes_the_superseded_conversion_of_its_file(tmp_path):
    """The float conversion (one per path, size and mtime: ~540 MB for the default model) went
    on disk for good each time its file changed."""
    path, other = tmp_path / "m.gguf", tmp_path / "sub" / "m.gguf"     # another file of the same name
    other.parent.mkdir()
    write_model(path, "llama", Q.Q4_1, embed=Q.Q8_0)
    write_model(other, "llama", Q.Q4_1, embed=Q.Q8_0)
    old, kept = converted_gguf_dir(path), converted_gguf_dir(other)
    os.utime(path, ns=(1, 1))
    new = converted_gguf_dir(path)
    assert new != old and not old.exists() and new.is_dir() and kept.is_dir()


def test_a_damaged_conversion_is_converted_again(tmp_path, monkeypatch, caplog):
    """A converted folder overwritten in place (loaded garbage: the default model answered ''), truncated
    (an error on every load) or missing its weights was trusted for good: its files are checked against
    the checksums written with it (once per process) and a damaged one is converted again."""
    from kvboost_engine import paths
    path = tmp_path / "m.gguf"
    write_model(path, "llama", Q.Q4_1, embed=Q.Q8_0)
    target = converted_gguf_dir(path)
    weights = target / "model.safetensors"
    good = weights.read_bytes()
    for damage in (lambda: weights.write_bytes(good[:100] + bytes(len(good) - 100)),     # same size, zeroed
                   lambda: weights.write_bytes(good[: len(good) // 2]), weights.unlink):
        monkeypatch.setattr(paths, "_WHOLE", set())                      # a new process
        damage()
        with caplog.at_level("WARNING"):
            assert converted_gguf_dir(path) == target
        assert "is damaged" in caplog.text and weights.read_bytes() == good
        caplog.clear()
    monkeypatch.setattr(paths, "_WHOLE", set())
    sums = (target / paths.SUMS).read_text()
    for odd in ("null", "[]", '"x"', '{"model.safetensors": 3}'):      # an odd checksum file: built again
        (target / paths.SUMS).write_text(odd)
        assert not paths.published(target, ".kvboost-complete")
    (target / paths.SUMS).write_text(sums)
    assert not [p for p in target.parent.iterdir() if p.name.startswith(".convert-")]    # nothing left aside
    import kvboost_engine.loading as loading
    monkeypatch.setattr(loading, "publish", lambda *a: pytest.fail("converted a whole folder again"))
    assert converted_gguf_dir(path) == target


def test_a_full_disk_while_converting_is_an_os_error(tmp_path, monkeypatch):
    """safetensors' own error on a full disk reached the user as a raw SafetensorError (fetch's
    one-line message is for OSErrors)."""
    from safetensors import SafetensorError
    from transformers import PreTrainedModel
    path = tmp_path / "m.gguf"
    write_model(path, "llama", Q.Q4_1, embed=Q.Q8_0)

    def full(self, *args, **kwargs):
        raise SafetensorError("Error while serializing: No space left on device (os error 28)")
    monkeypatch.setattr(PreTrainedModel, "save_pretrained", full)
    with pytest.raises(OSError, match="No space left"):
        converted_gguf_dir(path)
    assert not [p for p in (tmp_path / "home" / "models").iterdir() if not p.name.startswith(".")]


def test_a_full_disk_while_packing_names_the_folder_and_leaves_nothing(tmp_path, monkeypatch):
    """A pack (a GGUF as stored, an HF checkpoint in int4 / int8) cut by a full disk raised the bare
    "[Errno 28] No space left on device", naming no file and no way out."""
    import errno
    from kvboost_engine.weights import pack_file
    path, _write = tmp_path / "m.gguf", pack_file.PackWriter._write
    write_model(path, "llama", Q.Q4_0, embed=Q.Q8_0)

    def full(self, chunk):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(pack_file.PackWriter, "_write", full)
    with pytest.raises(OSError, match="cannot write .*No space left.*KVBOOST_HOME") as caught:
        packed_gguf_dir(path)
    assert caught.value.errno == errno.ENOSPC
    assert not [p for p in (tmp_path / "home" / "packed").iterdir() if p.name.startswith(".pack-")]
    monkeypatch.setattr(pack_file.PackWriter, "_write", _write)
    assert packed_gguf_dir(path) is not None                # room again: packed as usual


@pytest.mark.parametrize("weights", [None, "fp32"])
def test_a_token_id_past_the_vocabulary_is_an_input_error_naming_the_file(tmp_path, monkeypatch, weights):
    """(transformers' GGUF tokenizer reader raised a bare IndexError: list index out of range.)"""
    monkeypatch.setenv("KVBOOST_HOME", str(tmp_path / "home"))
    path = tmp_path / "t.gguf"
    write_model(path, "llama", Q.Q4_0, embed=Q.Q8_0)
    with pytest.raises(InputError, match=r"eos-.*\.gguf: its tokenizer cannot be read \(IndexError"):
        Engine.from_pretrained(_patched(path, tmp_path, "tokenizer.ggml.eos_token_id", 10**6, "eos"), weights=weights)


def test_a_changed_gguf_leaves_no_int4_pack_of_its_old_conversion(tmp_path, monkeypatch):
    """weights="int4" of a GGUF packs its float conversion; when the GGUF changed, the new conversion
    replaced the old one but the old one's pack (about the model's size) stayed for good."""
    monkeypatch.setenv("KVBOOST_HOME", str(tmp_path / "home"))
    path = tmp_path / "c.gguf"
    write_model(path, "llama", Q.Q8_0, embed=Q.Q8_0)
    load = lambda: load_model_and_tokenizer(resolve_model_dir(path, "int4"), device=torch.device("cpu"),  # noqa: E731
                                            dtype=torch.float32, weights="int4")
    load()                              # the loads an Engine makes (without building the native step here)
    packed = tmp_path / "home" / "packed"
    first = [p.name for p in packed.iterdir() if p.name.startswith("c-")]
    assert len(first) == 1
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))      # the file changed
    load()
    second = [p.name for p in packed.iterdir() if p.name.startswith("c-")]
    assert len(second) == 1 and second != first
    assert len([p for p in (tmp_path / "home" / "models").iterdir() if p.name.startswith("c-")]) == 1


def test_engine_loads_a_gguf_as_stored_and_decodes(tmp_path):
    path = tmp_path / "e.gguf"
    write_model(path, "llama", Q.Q4_0, embed=Q.Q8_0)
    # as stored by default where the native step runs; elsewhere a llama file loads as float32 unless asked
    engine = Engine.from_pretrained(path, weights=None if build.runs_here() else "gguf")
    try:
        out = engine.generate("Hello there", max_new_tokens=6, min_new_tokens=6)
        assert out.completion_tokens == 6
        stats = engine.stats()
        assert stats["weights_mapped_bytes"] > 0 and stats["weights_resident_bytes"] < 200_000
    finally:
        engine.close()


@pytest.mark.skipif(_NATIVE_CANNOT is not None, reason=str(_NATIVE_CANNOT))
@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_qwen3_and_gemma3_ggufs_load_as_stored_and_take_the_native_step(tmp_path, arch):
    """Qwen3 (an RMSNorm over each q / k head, head_dim 128 != hidden / heads) and Gemma 3 (those,
    (1 + w) norms, two more per layer, GELU, scaled embeddings, local and global rotaries) load as
    stored by default now that the native step runs them, and their native logits track the PyTorch
    loop over the same codes (up to the int8 rounding of the activations)."""
    if arch == "gemma3" and "gemma3_text" not in SUPPORTED_ARCHITECTURES:
        pytest.skip("Gemma 3 needs transformers 5")
    path = tmp_path / f"{arch}.gguf"
    write_model(path, arch, Q.Q4_0, embed=Q.Q8_0)
    assert gguf_model.stored_by_default(path)
    if arch == "qwen3":         # (the engine's prompt handling refuses this test file's tokenizer under Gemma's rules)
        engine = Engine.from_pretrained(path)
        try:
            assert engine.stats()["native_decode"] is True, engine.stats().get("native_decode_off")
            assert engine.generate("Hello there", max_new_tokens=4, min_new_tokens=4).completion_tokens == 4
        finally:
            engine.close()
    model, _ = load_model_and_tokenizer(packed_gguf_dir(path), device=CPU, dtype=F32)
    native_tracks_torch(model, IDS[0].tolist(), steps=8, capacity=64)      # without the q/k norms: 22 % off


def test_refusals_name_the_problem(tmp_path):
    path = tmp_path / "t.gguf"
    write_model(path, "llama", Q.Q4_0, embed=Q.Q8_0)
    data = path.read_bytes()
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(data[: len(data) - 4096])
    with pytest.raises(InputError, match="truncated"):
        packed_gguf_dir(truncated)
    with pytest.raises(InputError, match="weights='gguf'"):
        Engine.from_pretrained(tmp_path, weights="gguf")
    with pytest.raises(InputError, match="CPU with float32"):
        load_model_and_tokenizer(packed_gguf_dir(path), device=CPU, dtype=F32, weights="int4")


def test_default_load_as_stored_only_where_the_native_step_runs_it(tmp_path, monkeypatch):
    llama, gemma = tmp_path / "llama.gguf", tmp_path / "gemma.gguf"
    write_model(llama, "llama", Q.Q4_0, embed=Q.Q8_0)
    write_model(gemma, "gemma3", Q.Q4_0, embed=Q.Q8_0)
    assert gguf_model.stored_by_default(llama) and gguf_model.stored_by_default(gemma)    # the native step runs both
    assert not gguf_model.stored_by_default(gemma, native=False)   # the PyTorch loop would decode every matrix per token
    monkeypatch.setattr(gguf_model, "available_bytes", lambda: 1_000)     # a float32 copy cannot fit
    assert gguf_model.stored_by_default(gemma, native=False)
    # a llama file too, where the native step cannot run on this machine (the PyTorch loop would decode every
    # matrix per forward): float32 while it fits
    assert gguf_model.stored_by_default(llama, native=False)
    monkeypatch.setattr(gguf_model, "available_bytes", lambda: 1 << 40)
    assert not gguf_model.stored_by_default(llama, native=False)
    assert gguf_model.stored_by_default(llama, native=True)
    from kvboost_engine import loading
    monkeypatch.setattr(build, "runs_here", lambda: False)
    assert loading.resolve_model_dir(llama) == loading.converted_gguf_dir(llama)
    monkeypatch.setattr(build, "runs_here", lambda: True)
    assert loading.resolve_model_dir(llama) == packed_gguf_dir(llama)
    from kvboost_engine.weights.gguf_header import read_architecture
    assert read_architecture(llama.read_bytes()[:1 << 16]) == "llama"
    assert read_architecture(b"GGUF") is None and read_architecture(b"not a gguf") is None


def test_a_vocabulary_the_packed_layout_cannot_hold_loads_as_float32(tmp_path, monkeypatch):
    """A GGUF whose embedding has 274 rows (32,002 in the ChatML Mistral fine-tunes; not a multiple of 16)
    loads by default as float32, the one way it can (as stored it failed on its first matrix)."""
    import gguf_models
    from kvboost_engine.errors import UnsupportedModelError
    monkeypatch.setattr(gguf_models, "VOCAB", 274)
    path = tmp_path / "vocab274.gguf"
    write_model(path, "llama", Q.Q4_0, embed=Q.Q8_0)
    assert not gguf_model.stored_by_default(path)
    engine = Engine.from_pretrained(path)
    try:
        assert engine.generate("Hello there", max_new_tokens=3, min_new_tokens=3).completion_tokens == 3
    finally:
        engine.close()
    with pytest.raises(UnsupportedModelError, match="weights='fp32' loads the file"):
        Engine.from_pretrained(path, weights="gguf")


def test_a_damaged_pack_index_is_removed_and_the_next_load_repacks(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBOOST_HOME", str(tmp_path / "home"))
    path = tmp_path / "t.gguf"
    write_model(path, "llama", Q.Q4_0, embed=Q.Q8_0)
    pack = packed_gguf_dir(path)
    load_model_and_tokenizer(pack, device=CPU, dtype=F32)
    index = pack / "weights.json"
    index.write_text(index.read_text()[:100])               # cut: not JSON any more (was a JSONDecodeError, every load)
    with pytest.raises(InputError, match="is removed: loading the .gguf again repacks it"):
        load_model_and_tokenizer(pack, device=CPU, dtype=F32)
    assert not pack.exists()
    model, _ = load_model_and_tokenizer(packed_gguf_dir(path), device=CPU, dtype=F32)
    assert model is not None


@pytest.mark.parametrize("name, cut", [("config.json", 30), ("tokenizer.json", 0)])
def test_a_damaged_config_or_tokenizer_of_a_pack_is_repacked(tmp_path, monkeypatch, name, cut):
    """Only the weights file was checked: a cut config.json or tokenizer.json failed every load (OSError,
    JSONDecodeError) and was never repaired."""
    path = tmp_path / "t.gguf"
    write_model(path, "llama", Q.Q4_0, embed=Q.Q8_0)
    pack = packed_gguf_dir(path)
    whole = (pack / name).read_bytes()
    (pack / name).write_bytes(whole[:cut])
    model, tokenizer = load_model_and_tokenizer(pack, device=CPU, dtype=F32)
    assert model is not None and tokenizer is not None and (pack / name).read_bytes() == whole


def _patched(path, tmp_path, key: str, value: int, name: str | None = None):
    """A copy of a GGUF with one uint32 metadata value changed (key, then its type id, then the value)."""
    data = bytearray(path.read_bytes())
    at = data.index(key.encode()) + len(key) + 4
    data[at:at + 4] = value.to_bytes(4, "little")
    out = tmp_path / f"{name or key}-{value}.gguf"
    out.write_bytes(bytes(data))
    return out


def test_metadata_that_disagrees_with_the_tensors_is_refused_at_load(tmp_path, monkeypatch):
    """(It loaded, and every request then failed in a matrix product; a block_count below the file's
    layers loaded a truncated model that answered garbage.)"""
    monkeypatch.setenv("KVBOOST_HOME", str(tmp_path / "home"))
    path = tmp_path / "t.gguf"
    write_model(path, "llama", Q.Q4_0, embed=Q.Q8_0)
    with pytest.raises(InputError, match=r"tensor blk.0.attn_k.weight is \[128, 256\], but the model its metadata"):
        Engine.from_pretrained(_patched(path, tmp_path, "llama.attention.head_count_kv", 4))
    with pytest.raises(InputError, match="tensors of layers past its llama.block_count of 1"):
        Engine.from_pretrained(_patched(path, tmp_path, "llama.block_count", 1))


def test_the_float32_conversion_refuses_what_the_packed_load_refuses(tmp_path, monkeypatch):
    """weights="fp32" (and any file the native step cannot take) went through transformers, which
    fills a missing tensor with random values and drops a layer past block_count: it loaded, answered
    garbage, and the broken conversion was cached for every later load; a shape that disagrees with the
    metadata was transformers' "You set `ignore_mismatched_sizes` to `False`" (the user set nothing)."""
    monkeypatch.setenv("KVBOOST_HOME", str(tmp_path / "home"))
    path = tmp_path / "t.gguf"
    write_model(path, "llama", Q.Q4_0, embed=Q.Q8_0)
    with pytest.raises(InputError, match="tensors of layers past its llama.block_count of 1"):
        Engine.from_pretrained(_patched(path, tmp_path, "llama.block_count", 1), weights="fp32")
    with pytest.raises(InputError, match=r"lacks tensor blk.2.attn_norm.weight \(9 missing in all\)"):
        Engine.from_pretrained(_patched(path, tmp_path, "llama.block_count", 3), weights="fp32")
    with pytest.raises(InputError, match="a tensor's shape disagrees with the model its metadata describes"):
        Engine.from_pretrained(_patched(path, tmp_path, "llama.attention.head_count_kv", 4), weights="fp32")
    models = tmp_path / "home" / "models"
    assert not models.exists() or not [p for p in models.iterdir() if not p.name.startswith(".")]


def test_hostile_headers_are_input_errors():
    """A key given twice, arrays nested without end (a RecursionError before), an alignment that is not
    an integer (a ValueError, or a float silently truncated)."""
    import struct

    from kvboost_engine.weights.gguf_header import read_header

    def header(*fields: bytes) -> bytes:
        return b"GGUF" + struct.pack("<IQQ", 3, 0, len(fields)) + b"".join(fields)

    def key(name: str) -> bytes:
        return struct.pack("<Q", len(name)) + name.encode()

    u32 = lambda name, v: key(name) + struct.pack("<II", 4, v)                  # noqa: E731
    with pytest.raises(InputError, match="metadata key 'a' twice"):
        read_header(header(u32("a", 1), u32("a", 2)))
    nested = key("x") + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 5000 + struct.pack("<IQ", 4, 0)
    with pytest.raises(InputError, match="nests arrays more than"):
        read_header(header(nested))
    text = key("general.alignment") + struct.pack("<I", 8) + struct.pack("<Q", 2) + b"32"
    with pytest.raises(InputError, match="general.alignment must be an integer"):
        read_header(header(text))
    assert read_header(header(u32("general.alignment", 64))).alignment == 64


def test_tensors_the_model_would_not_read_are_refused_by_both_paths(tmp_path, monkeypatch):
    """A llama GGUF with block biases (llama.cpp adds them) loaded without them, as stored and as
    float32: other logits than llama.cpp's, without a word."""
    from kvboost_engine.errors import UnsupportedModelError
    monkeypatch.setenv("KVBOOST_HOME", str(tmp_path / "home"))
    path = tmp_path / "llama_bias.gguf"
    write_model(path, "llama", Q.F32, embed=Q.F32, bias=True)
    for load in (packed_gguf_dir, converted_gguf_dir):
        with pytest.raises(UnsupportedModelError, match="attn_q.bias"):
            load(path)
    plain = tmp_path / "qwen2.gguf"                     # Qwen2's own q / k / v biases are read
    write_model(plain, "qwen2", Q.F32, embed=Q.F32, bias=True)
    assert converted_gguf_dir(plain).is_dir()


def test_a_tokenizer_transformers_cannot_build_is_an_input_error_naming_the_file(tmp_path, monkeypatch):
    """The tokenizers library raises a bare Exception ("Error while initializing BPE: Token '\\n' out of
    vocabulary", a llama.cpp-converted Gemma 3 with a gpt2-type vocabulary): it came out as it was."""
    import transformers

    from kvboost_engine.weights.gguf_config import gguf_tokenizer
    path = tmp_path / "t.gguf"
    write_model(path, "llama", Q.Q4_0, embed=Q.Q8_0)

    def unbuildable(*args, **kwargs):
        raise Exception("Error while initializing BPE: Token `\n` out of vocabulary")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", unbuildable)
    with pytest.raises(InputError, match="(?s)t.gguf: transformers cannot build its tokenizer .*tokenizer.ggml.model is"):
        gguf_tokenizer(path)
