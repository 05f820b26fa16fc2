"""GGUF tensors read as stored (weights/gguf_blocks.py, gguf_file.py): our dequantization equals the
`gguf` package's bit for bit on tiny random GGUFs written with the `gguf` package (and on the
default model's real Q4_1 file); bad files are refused with the tensor or type named."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter, quants

from kvboost_engine.errors import InputError, UnsupportedModelError
from kvboost_engine.weights.gguf_blocks import blocks, dequantize
from kvboost_engine.weights.gguf_file import REQUIRED_BLOCK_TENSORS, GGUFFile, check_gguf, gguf_weight_bytes

Q = GGMLQuantizationType
HIDDEN, INTER, VOCAB, HEAD_DIM, KV_HEADS = 64, 96, 80, 16, 2


def _shapes(arch: str) -> dict:
    """[rows, columns] of each block tensor of a tiny model (a norm is 1-D)."""
    kv = KV_HEADS * HEAD_DIM
    return {"attn_q": (HIDDEN, HIDDEN), "attn_k": (kv, HIDDEN), "attn_v": (kv, HIDDEN),
            "attn_output": (HIDDEN, HIDDEN), "attn_qkv": (HIDDEN + 2 * kv, HIDDEN),
            "ffn_gate": (INTER, HIDDEN), "ffn_up": (INTER, HIDDEN), "ffn_down": (HIDDEN, INTER),
            "attn_q_norm": (HEAD_DIM,), "attn_k_norm": (HEAD_DIM,)}


def write_gguf(path, arch: str, qtype: GGMLQuantizationType, layers: int = 2, skip: str = "") -> None:
    """A tiny random model: matrices in `qtype`, norms in F32, the file written by the gguf package."""
    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_name("Mistral tiny" if arch == "llama" else f"{arch} tiny")
    tensors = {"token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,)}
    for i in range(layers):
        for part in REQUIRED_BLOCK_TENSORS.get(arch, REQUIRED_BLOCK_TENSORS["llama"]):
            tensors[f"blk.{i}.{part}.weight"] = _shapes(arch).get(part, (HIDDEN,))
    for name, shape in tensors.items():
        if name == skip:
            continue
        values = rng.standard_normal(shape).astype(np.float32) * 0.05
        if len(shape) == 1:
            writer.add_tensor(name, values)
        else:
            writer.add_tensor(name, quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def assert_exact(path) -> int:
    """Every tensor of the file: ours == gguf.quants.dequantize, bit for bit. Returns how many."""
    ours = GGUFFile(path).tensors
    reader = GGUFReader(path)
    for t in reader.tensors:
        reference = torch.from_numpy(np.array(quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
        mine = dequantize(ours[t.name])
        assert mine.dtype == torch.float32 and mine.shape == reference.shape, t.name
        assert torch.equal(mine.view(torch.int32), reference.view(torch.int32)), (t.name, t.tensor_type.name)
    return len(reader.tensors)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("arch,model_type", [("llama", "llama"), ("qwen2", "qwen2"), ("gemma3", "gemma3_text"),
                                             ("qwen3", "qwen3"), ("phi3", "phi3")])
def test_tiny_models_dequantize_bit_for_bit(tmp_path, arch, model_type, qtype):
    path = tmp_path / f"{arch}.gguf"
    write_gguf(path, arch, qtype)
    summary = check_gguf(path)
    assert (summary.architecture, summary.model_type, summary.layers) == (arch, model_type, 2)
    assert summary.types[qtype.name] > 0 and summary.types["F32"] > 0
    assert assert_exact(path) == sum(summary.types.values())


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.F32], ids=lambda q: q.name)
def test_float_tensors_bit_for_bit(tmp_path, qtype):
    path = tmp_path / "float.gguf"
    write_gguf(path, "llama", qtype, layers=1)
    assert check_gguf(path).types[qtype.name] > 0
    assert_exact(path)


def _random_kquant_file(path, qtype, rows=4, columns=512) -> None:
    """K-quant blocks of random bytes (the gguf package cannot quantize to them), finite fp16 scales."""
    rng = np.random.default_rng(1)
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, columns // block, block_bytes), dtype=np.uint8)
    halves = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}[qtype]
    for start in halves:        # d, dmin: finite, of either sign
        raw[..., start:start + 2] = (rng.standard_normal(raw.shape[:2]) * 0.01).astype(np.float16)[..., None].view(np.uint8)
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.ffn_down.weight", raw.reshape(rows, -1), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda q: q.name)
def test_k_quants_bit_for_bit(tmp_path, qtype):
    path = tmp_path / "k.gguf"
    _random_kquant_file(path, qtype)
    assert assert_exact(path) == 1
    q = blocks(GGUFFile(path).tensors["blk.0.ffn_down.weight"])
    assert q.codes.shape == (4, 512) and int(q.codes.max()) == {Q.Q4_K: 15, Q.Q5_K: 31, Q.Q6_K: 63}[qtype]
    assert q.scales.shape == (4, 512 // q.group) and q.scales.dtype == torch.float32


def test_inexact_type_is_refused_with_type_and_tensor(tmp_path):
    path = tmp_path / "q2_k.gguf"
    writer = GGUFWriter(str(path), "llama")
    block, block_bytes = GGML_QUANT_SIZES[Q.Q2_K]
    raw = np.random.default_rng(3).integers(0, 256, (4, 256 // block * block_bytes), dtype=np.uint8)
    writer.add_tensor("blk.0.ffn_down.weight", raw, raw_dtype=Q.Q2_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensor = GGUFFile(path).tensors["blk.0.ffn_down.weight"]
    with pytest.raises(UnsupportedModelError, match="type Q2_K of tensor blk.0.ffn_down.weight has no exact repack"):
        dequantize(tensor)
    with pytest.raises(UnsupportedModelError, match="Q2_K of tensor blk.0.ffn_down.weight"):
        check_gguf(path)


def test_block_layout_by_hand(tmp_path):
    """Q4_0: element i of a block is the low nibble of byte i, element 16 + i its high nibble; (q - 8) * d."""
    path = tmp_path / "hand.gguf"
    block = np.zeros((1, 32 // 32, 18), dtype=np.uint8)
    block[0, 0, :2] = np.array([0.5], dtype=np.float16).view(np.uint8)
    block[0, 0, 2] = 0x2B                                       # element 0: 11, element 16: 2
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("w", block.reshape(1, 18), raw_dtype=Q.Q4_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensor = GGUFFile(path).tensors["w"]
    q = blocks(tensor)
    assert (q.codes[0, 0].item(), q.codes[0, 16].item(), q.codes[0, 1].item(), q.zero_code) == (11, 2, 0, 8)
    values = dequantize(tensor)[0]
    assert (values[0].item(), values[16].item(), values[1].item()) == (1.5, -3.0, -4.0)


def test_truncated_file_is_refused_naming_the_tensor(tmp_path):
    path = tmp_path / "llama.gguf"
    write_gguf(path, "llama", Q.Q4_1)
    last = GGUFReader(path).tensors[-1].name
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(InputError, match=f"tensor {last} .*truncated"):
        check_gguf(path)
    path.write_bytes(data[:200])                                # cut inside the header
    with pytest.raises(InputError, match="truncated or corrupt"):
        check_gguf(path)


def test_unknown_tensor_type_is_refused_naming_the_tensor(tmp_path):
    path = tmp_path / "llama.gguf"
    write_gguf(path, "llama", Q.Q8_0)
    info = GGUFReader(path).tensors[3].field          # parts: name length, name, n_dims, dims, type, offset
    type_at = info.offset + sum(int(part.nbytes) for part in info.parts[:4])
    data = bytearray(path.read_bytes())
    assert int.from_bytes(data[type_at:type_at + 4], "little") == Q.Q8_0.value
    data[type_at:type_at + 4] = (250).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(InputError, match=f"tensor {info.name}: unknown tensor type id 250"):
        check_gguf(path)


def test_unsupported_architecture_is_refused_by_name(tmp_path):
    path = tmp_path / "rwkv.gguf"
    write_gguf(path, "rwkv", Q.Q8_0, layers=1)
    with pytest.raises(UnsupportedModelError, match="GGUF architecture 'rwkv' is not supported"):
        check_gguf(path)


def test_missing_tensor_is_refused_by_name(tmp_path):
    path = tmp_path / "qwen2.gguf"
    write_gguf(path, "qwen2", Q.Q4_0, skip="blk.1.ffn_down.weight")
    with pytest.raises(InputError, match="lacks tensor blk.1.ffn_down.weight"):
        check_gguf(path)


def test_weight_bytes_are_the_stored_tensors(tmp_path):
    path = tmp_path / "llama.gguf"
    write_gguf(path, "llama", Q.Q4_1)
    reader = GGUFReader(path)
    assert gguf_weight_bytes(path) == sum(int(t.data.nbytes) for t in reader.tensors)
    q4_1 = [t for t in reader.tensors if t.tensor_type == Q.Q4_1]
    assert all(t.n_bytes == t.n_elements // 32 * 20 for t in q4_1)            # 2 + 2 + 16 bytes a block
    assert gguf_weight_bytes(path) < path.stat().st_size


def test_default_model_gguf_bit_for_bit():
    """The real SmolLM2-135M Q4_1 file (Q8_0 embedding, F32 norms): a few tensors, bit for bit."""
    from kvboost_engine.loading import default_gguf_file
    try:
        path = default_gguf_file()
    except Exception as err:                                    # no package, no network: nothing to check
        pytest.skip(f"default GGUF unavailable: {err}")
    summary = check_gguf(path)
    assert summary.model_type == "llama" and summary.types.get("Q4_1", 0) > 0
    file, reader = GGUFFile(path), GGUFReader(path)
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "llama.rope.freq_base"):
        assert np.array_equal(np.asarray(file.field(key)), np.asarray(reader.fields[key].contents())), key
    ours = file.tensors
    wanted = {"blk.0.attn_q.weight", "blk.0.ffn_down.weight", "blk.0.attn_norm.weight", "blk.29.ffn_up.weight"}
    for t in reader.tensors:
        if t.name in wanted or t.tensor_type == Q.Q8_0:
            reference = torch.from_numpy(np.array(quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
            assert torch.equal(dequantize(ours[t.name]).view(torch.int32), reference.view(torch.int32)), t.name
            wanted.discard(t.name)
    assert not wanted


def test_header_matches_the_gguf_reader(tmp_path):
    path = tmp_path / "qwen2.gguf"
    write_gguf(path, "qwen2", Q.Q4_0)
    ours, reader = GGUFFile(path), GGUFReader(path)
    for key in ("general.architecture", "general.name", "qwen2.block_count", "general.alignment"):
        if key in reader.fields:
            assert ours.field(key) == reader.fields[key].contents(), key
    assert [(t.name, t.type_name, t.nbytes) for t in ours.tensors.values()] == \
        [(t.name, t.tensor_type.name, int(t.n_bytes)) for t in reader.tensors]
    assert all(ours.tensors[t.name].raw.tobytes() == t.data.tobytes() for t in reader.tensors)


def test_any_cut_or_flipped_header_byte_is_refused_cleanly(tmp_path):
    """Every cut inside the header, and every header byte set to 0xFF, opens or raises InputError:
    never another exception, never a read past the end."""
    path = tmp_path / "llama.gguf"
    write_gguf(path, "llama", Q.Q8_0, layers=1)
    data = path.read_bytes()
    header_end = GGUFReader(path).data_offset
    broken = tmp_path / "broken.gguf"
    refused = 0
    for at in range(0, header_end, 3):
        for variant in (data[:at], data[:at] + b"\xff" + data[at + 1:]):
            broken.write_bytes(variant)
            try:
                GGUFFile(broken)
            except InputError:
                refused += 1
    assert refused > header_end // 3                           # every cut at least
