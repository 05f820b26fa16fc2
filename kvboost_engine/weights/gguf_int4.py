"""A GGUF Q4_0 / Q4_1 tensor in the CPU int4 kernel's layout (aten._weight_int4pack_mm_for_cpu),
with weights equal to the GGUF dequantization: groundwork for loading a GGUF without a float copy.

The kernel decodes w = (q - 8) * scale + zero per group of 32 input columns; a GGUF block decodes
to (q - 8) * d (Q4_0) or q * d + m (Q4_1). With scale = d and zero = 0 (Q4_0) or m + 8 * d (Q4_1)
the two agree exactly: (q - 8) * d is exact in float32 (a 4-bit integer times an 11-bit fp16), so
the one rounding is of the same sum, provided m + 8 * d itself is exact in float32 (checked).

This needs float32 scale_zeros and float32 activations: bfloat16 (Int4Linear's activation and scale
dtype) holds only about 7% of a real file's fp16 scales, float16 rounds m + 8 * d. Standalone: the
engine's int4 layers (formats.Int4Linear) still compute in bfloat16.
"""
from __future__ import annotations

import torch

from ..errors import UnsupportedModelError
from .formats import INT4_GROUP, int4_supported, pack_int4
from .gguf_blocks import GGUFTensor, blocks


def int4_kernel_parts(tensor: GGUFTensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A Q4_0 / Q4_1 matrix [N, K] -> (packed codes, scale_zeros float32 [K/32, N, 2], pack block size)
    for `aten._weight_int4pack_mm_for_cpu(rows float32, packed, 32, scale_zeros)`."""
    if tensor.type_name not in ("Q4_0", "Q4_1"):
        raise UnsupportedModelError(f"type {tensor.type_name} of tensor {tensor.name} has no exact int4 kernel "
                                    "layout (Q4_0 and Q4_1 have)")
    if len(tensor.shape) != 2 or not int4_supported(*tensor.shape, INT4_GROUP):
        raise UnsupportedModelError(f"tensor {tensor.name} of shape {list(tensor.shape)} does not fit the int4 "
                                    "kernel (a matrix with rows a multiple of 16, columns of 32)")
    q = blocks(tensor)
    scales = q.scales                                                       # [N, K/32] float32
    if q.mins is None:
        zeros = torch.zeros_like(scales)
    else:
        zeros = q.mins + 8 * scales
        inexact = zeros.double() != q.mins.double() + 8 * scales.double()
        if inexact.any():
            row, group = (int(i) for i in inexact.nonzero()[0])
            raise UnsupportedModelError(f"tensor {tensor.name}: m + 8 * d of block ({row}, {group}) is not "
                                        "exact in float32, so the int4 kernel cannot decode it exactly")
    packed, block = pack_int4(q.codes.to(torch.int32))
    scale_zeros = torch.stack([scales.T, zeros.T], dim=-1).contiguous()      # [K/32, N, 2]
    return packed, scale_zeros, block
