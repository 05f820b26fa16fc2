"""GGUF Q4_0 / Q4_1 tensors in the CPU int4 kernel's layout (weights/gguf_int4.py): the kernel's
weights, read back through an identity matmul in float32, equal the GGUF dequantization."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, quants

from kvboost_engine.errors import UnsupportedModelError
from kvboost_engine.weights.gguf_blocks import dequantize
from kvboost_engine.weights.gguf_file import GGUFFile
from kvboost_engine.weights.gguf_int4 import int4_kernel_parts

Q = GGMLQuantizationType
pytestmark = pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"),
                                reason="this PyTorch has no CPU int4 kernel")


def _write(path, tensors: dict) -> GGUFFile:
    """name -> (uint8 blocks or float32 array, type)."""
    writer = GGUFWriter(str(path), "llama")
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFFile(path)


def kernel_weights(tensor) -> torch.Tensor:
    """The weight [N, K] the int4 kernel computes with (rows of an identity matrix times it)."""
    packed, scale_zeros, _block = int4_kernel_parts(tensor)
    eye = torch.eye(tensor.shape[1])
    return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, packed, 32, scale_zeros).T


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_kernel_weights_equal_the_gguf_dequantization(tmp_path, qtype):
    rng = np.random.default_rng(2)
    values = (rng.standard_normal((64, 256)) * 0.05).astype(np.float32)
    tensor = _write(tmp_path / "w.gguf", {"w": (quants.quantize(values, qtype), qtype)}).tensors["w"]
    assert torch.equal(kernel_weights(tensor), dequantize(tensor))
    packed, scale_zeros, block = int4_kernel_parts(tensor)
    assert scale_zeros.dtype == torch.float32 and scale_zeros.shape == (256 // 32, 64, 2) and block


def test_inexact_zero_and_other_types_are_refused(tmp_path):
    block = np.zeros((16, 1, 20), dtype=np.uint8)
    block[..., 0:2] = np.array([1.0], dtype=np.float16).view(np.uint8)
    block[..., 2:4] = np.array([2.0 ** -24], dtype=np.float16).view(np.uint8)      # 8 + 2**-24 needs 28 bits
    values = np.zeros((16, 32), dtype=np.float32)
    file = _write(tmp_path / "w.gguf", {"w": (block.reshape(16, 20), Q.Q4_1), "f": (values, Q.F32)})
    with pytest.raises(UnsupportedModelError, match=r"tensor w: m \+ 8 \* d of block \(0, 0\) is not exact"):
        int4_kernel_parts(file.tensors["w"])
    with pytest.raises(UnsupportedModelError, match="type F32 of tensor f has no exact int4"):
        int4_kernel_parts(file.tensors["f"])


def test_default_model_q4_1_tensors_in_the_kernel_exactly():
    from kvboost_engine.loading import default_gguf_file
    try:
        path = default_gguf_file()
    except Exception as err:                                    # no package, no network: nothing to check
        pytest.skip(f"default GGUF unavailable: {err}")
    tensors = GGUFFile(path).tensors
    for name in ("blk.0.attn_k.weight", "blk.29.attn_v.weight"):
        assert tensors[name].type_name == "Q4_1"
        assert torch.equal(kernel_weights(tensors[name]), dequantize(tensors[name])), name
