"""AWQ GEMM format: packing order against hand-made tensors, dequantization, config checks."""
from __future__ import annotations

import pytest
import torch

from kvboost_engine.weights.awq.format import AWQConfig, awq_config_of, dequantize, pack_int4, unpack_int4
from kvboost_tools.awq.grid import quantize_groups
from kvboost_engine.weights.awq.kernels import CpuInt4PackLayout, DequantLayout, cpu_int4pack_works
from kvboost_engine.errors import UnsupportedModelError

# AutoAWQ GEMM: nibble i of each int32 holds column order[i] of its 8 columns, order = 0,2,4,6,1,3,5,7.
# Columns holding 1..8 therefore pack (low nibble first) as 1,3,5,7,2,4,6,8 -> 0x86427531.
PACKED_1_TO_8 = 0x86427531 - (1 << 32)           # as the signed int32 AutoAWQ stores


def test_pack_matches_documented_order():
    values = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    assert pack_int4(values).tolist() == [[PACKED_1_TO_8]]
    assert pack_int4(values).dtype == torch.int32


def test_unpack_hand_made_words():
    packed = torch.tensor([[PACKED_1_TO_8, 0x0000000F, 0x10000000]], dtype=torch.int32)
    got = unpack_int4(packed).tolist()[0]
    assert got[:8] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert got[8:16] == [15, 0, 0, 0, 0, 0, 0, 0]         # nibble 0 -> column 0
    assert got[16:24] == [0, 0, 0, 0, 0, 0, 0, 1]         # nibble 7 -> column 7


def test_pack_unpack_round_trip():
    values = torch.randint(0, 16, (12, 40), generator=torch.Generator().manual_seed(1))
    assert torch.equal(unpack_int4(pack_int4(values)).long(), values)


def test_dequantize_hand_made():
    # K=4 rows, N=8 columns, group 2: rows 0-1 use zeros/scales row 0, rows 2-3 row 1.
    q = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]] * 4)
    zeros = torch.tensor([[1] * 8, [8] * 8])
    scales = torch.tensor([[0.5] * 8, [2.0] * 8], dtype=torch.float16)
    w = dequantize(pack_int4(q), pack_int4(zeros), scales, group_size=2)
    assert w[0].tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5]
    assert w[3].tolist() == [-14.0, -12.0, -10.0, -8.0, -6.0, -4.0, -2.0, 0.0]


def test_quantize_groups_error_within_half_step():
    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))      # nn.Linear [N, K]
    qweight, qzeros, scales = quantize_groups(weight, 32)
    assert qweight.shape == (64, 2) and qzeros.shape == (2, 2) and scales.shape == (2, 16)
    error = (dequantize(qweight, qzeros, scales, 32).T - weight).abs()           # [N, K]
    step = scales.float().T.repeat_interleave(32, 1)
    assert bool((error <= step / 2 + 1e-6).all())


@pytest.mark.parametrize("quant, message", [
    ({"version": "gemv"}, "GEMM layout only"),
    ({"bits": 8}, "8 bits"),
    ({"zero_point": False}, "zero points"),
    ({"group_size": -1}, "group size"),
])
def test_unsupported_configs_fail_clearly(quant, message):
    base = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
    with pytest.raises(UnsupportedModelError, match=message):
        AWQConfig.from_dict({**base, **quant})


def test_config_reads_autoawq_spellings():
    legacy = {"quant_method": "awq", "w_bit": 4, "q_group_size": 64, "zero_point": True, "version": "GEMM"}
    assert AWQConfig.from_dict(legacy) == AWQConfig(4, 64, True, "gemm")
    assert awq_config_of({"quantization_config": {"quant_method": "gptq"}}) is None
    assert awq_config_of({}) is None


@pytest.mark.skipif(not cpu_int4pack_works(), reason="no CPU int4 kernel in this PyTorch")
def test_cpu_int4pack_layout_matches_dequant():
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(48, 128, generator=gen)
    qweight, qzeros, scales = quantize_groups(weight, 64)
    x = torch.randn(5, 128, generator=gen)
    fast, plain = CpuInt4PackLayout(), DequantLayout()
    got = fast.matmul(x, fast.prepare(qweight, qzeros, scales, 64), 64)
    want = plain.matmul(x.bfloat16().float(), plain.prepare(qweight, qzeros, scales, 64), 64)
    assert torch.allclose(got, want, rtol=0.02, atol=0.05)


def test_fake_quantize_equals_packed_round_trip():
    weight = torch.randn(24, 128, generator=torch.Generator().manual_seed(3))
    from kvboost_tools.awq.grid import fake_quantize
    assert torch.equal(fake_quantize(weight, 64), dequantize(*quantize_groups(weight, 64), 64).T)


def test_clip_search_never_worse_than_no_clip():
    from kvboost_tools.awq.grid import fake_quantize
    from kvboost_tools.awq.search import search_clip
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(8, 64, generator=gen) * torch.rand(1, 64, generator=gen)
    weight[:, 5] = 6.0                                   # an outlier that clipping should cut
    x = torch.randn(256, 64, generator=gen)
    clip = search_clip(weight, x, 32)

    def group_errors(c):                                 # [N, groups]: each group's output error
        diff = (weight - fake_quantize(weight, 32, c)).reshape(8, 2, 32)
        return torch.einsum("tgc,ngc->ngt", x.reshape(-1, 2, 32), diff).pow(2).mean(-1)
    assert bool((group_errors(clip) <= group_errors(None) + 1e-6).all())
    assert bool((clip <= 1).all()) and bool((clip < 1).any())
