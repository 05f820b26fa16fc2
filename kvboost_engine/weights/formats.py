"""CPU weight formats for a float model's linear layers and embedding: bf16, int8, int4.

Each module keeps its converted tensors as buffers (so they are part of the state dict and of
the model fingerprint), takes activations in the model's dtype and returns them in it: the
residual stream, norms and KV stay as they were; only the matmuls read the smaller weights.

- bf16: the weight rounded to bfloat16; activations cast to bf16 for the matmul.
- int8: symmetric per output channel (`aten._weight_int8pack_mm`, bf16 activations).
- int4: asymmetric groups of 32 input columns (`aten._weight_int4pack_mm_for_cpu`, bf16
  activations), the layout of weights/awq/kernels.py's cpu-int4pack.

The int8/int4 kernels are matrix-vector kernels: fast for a decode step, 5-10x slower than a
dense bf16 matmul for a long prefill. From `dense_from_rows` rows on, a forward dequantizes
the weight to bf16 and runs a dense matmul instead (measured in benchmarks/micro/weights.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ACT_DTYPE = torch.bfloat16
INT4_GROUP = 32
INT4_BLOCKS = (64, 32)          # rows per block of the CPU int4 pack layout (AVX512, AVX2), tried in order


def _bf16_up(values: torch.Tensor) -> torch.Tensor:
    """`values` (fp32, > 0) rounded up to the next bfloat16, so a scale never shrinks."""
    rounded = values.to(ACT_DTYPE)
    low = rounded.float() < values
    return torch.where(low, torch.nextafter(rounded, torch.full_like(rounded, float("inf"))), rounded)


def quantize_int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (codes int8 [N, K], scales bf16 [N]) with weight ~= codes * scales[:, None].

    The scale is chosen as a bf16 value first (the kernel reads bf16 scales), so the codes are
    computed against the very scale the matmul uses."""
    w = weight.detach().float()
    scales = _bf16_up(w.abs().amax(dim=1).clamp(min=1e-12) / 127)
    codes = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return codes.contiguous(), scales.contiguous()


def quantize_int4_groups(weight: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (codes int32 [N, K] in 0..15, scale_zeros bf16 [K/g, N, 2]) for the CPU
    int4 kernel, which computes w = (q - 8) * scale + zero (zero = group min + 8 * scale)."""
    n, k = weight.shape
    w = weight.detach().float().view(n, k // group, group)
    low, high = w.amin(dim=-1), w.amax(dim=-1)                                 # [N, K/g]
    scale = _bf16_up(((high - low) / 15).clamp(min=1e-12))
    zero = (low + 8 * scale.float()).to(ACT_DTYPE)
    offset = zero.float() - 8 * scale.float()                                   # what q = 0 decodes to
    codes = torch.round((w - offset[..., None]) / scale.float()[..., None]).clamp(0, 15).to(torch.int32)
    scale_zeros = torch.stack([scale.T, zero.T], dim=-1).contiguous()           # [K/g, N, 2]
    return codes.view(n, k), scale_zeros


def int4_supported(n: int, k: int, group: int = INT4_GROUP) -> bool:
    """Whether the CPU int4 kernel takes a [n, k] weight with this group size."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and k % group == 0 and n % 16 == 0


def unpack_int4(packed: torch.Tensor, n: int, k: int, block: int) -> torch.Tensor:
    """Codes uint8 [n, k] back from the CPU pack layout: blocks of `block` rows, each stored as
    [k, block/2] bytes whose low nibble is row j and high nibble row j + block/2."""
    half = block // 2
    p = packed.view(n // block, k, half)
    codes = torch.empty(n // block, block, k, dtype=torch.uint8)
    codes[:, :half] = (p & 15).transpose(1, 2)
    codes[:, half:] = (p >> 4).transpose(1, 2)
    return codes.view(n, k)


def pack_int4(codes: torch.Tensor) -> tuple[torch.Tensor, int]:
    """codes int32 [N, K] -> (packed uint8 for the kernel, its block size for `unpack_int4`, or 0
    when this PyTorch's layout is not the one `unpack_int4` reads: then no dense prefill path)."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 2)
    n, k = codes.shape
    for block in INT4_BLOCKS:
        if n % block == 0 and tuple(packed.shape) == (n, k // 2) and \
                torch.equal(unpack_int4(packed, n, k, block), codes.to(torch.uint8)):
            return packed, block
    return packed, 0


class _FormatLinear(nn.Module):
    """Shared shape handling: [..., K] in the model dtype -> [..., N] in the same dtype (+ bias)."""

    dense_from_rows = 1 << 62       # rows from which a forward dequantizes to bf16 (never by default)

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.exact_top = 0          # > 0 on an output head: recompute each row's top outputs in float32
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)                                # [M, K]
        rows = flat.to(ACT_DTYPE)
        if rows.shape[0] >= self.dense_from_rows:
            out = self.dense_matmul(rows)
        else:
            out = self.matmul(rows)                                           # [M, N] bf16
        out = out.to(x.dtype)
        if self.exact_top:
            out = self._refine_top(flat, out)
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out + self.bias if self.bias is not None else out

    def _refine_top(self, flat: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """A bf16 logit has 8 bits of mantissa (steps of 0.125 near 25): close candidates tie or
        swap. The top `exact_top` outputs per row are recomputed from the float activations and
        the float value of the stored weights, so greedy choices see exact dot products."""
        top = out.float().topk(self.exact_top, dim=-1).indices                 # [M, T]
        weights = self.float_rows(top.reshape(-1)).view(*top.shape, self.in_features)   # [M, T, K]
        exact = torch.einsum("mk,mtk->mt", flat.float(), weights)
        return out.float().scatter(1, top, exact).to(out.dtype)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dense_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return self.matmul(rows)

    def float_rows(self, index: torch.Tensor) -> torch.Tensor:
        """Weight rows `index` [T] as float32 [T, K] (for `exact_top`)."""
        raise NotImplementedError

    def converted(self) -> dict[str, torch.Tensor]:
        """The converted weight tensors (what the on-disk cache stores), by name."""
        return {name: buf for name, buf in self.named_buffers(recurse=False) if name != "bias"}

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Bf16Linear(_FormatLinear):
    """nn.Linear with a bfloat16 weight [N, K]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__(weight.shape[1], weight.shape[0], bias)
        self.register_buffer("weight", weight.to(ACT_DTYPE).contiguous())

    def matmul(self, rows):
        return F.linear(rows, self.weight)

    def float_rows(self, index):
        return self.weight[index].float()


class Int8Linear(_FormatLinear):
    """nn.Linear with an int8 weight [N, K] and a bf16 scale per output channel."""

    dense_from_rows = 32

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        super().__init__(qweight.shape[1], qweight.shape[0], bias)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)

    def matmul(self, rows):
        return torch.ops.aten._weight_int8pack_mm(rows, self.qweight, self.scales)

    def dense_matmul(self, rows):
        # the per-channel scale commutes with the matmul: one cast of the codes, one dense GEMM
        return F.linear(rows, self.qweight.to(ACT_DTYPE)) * self.scales

    def float_rows(self, index):
        return self.qweight[index].float() * self.scales[index].float()[:, None]


class Int4Linear(_FormatLinear):
    """nn.Linear with an int4 weight (groups of `group` input columns) in the CPU pack layout."""

    # the kernel costs ~2.1 ms per row over the default model's layers, the dense path ~220 ms to
    # dequantize plus ~0.8 ms per row (2 cores, 2026-12-01): 100 rows 236 vs 331 ms, 192 rows 415 vs 333
    dense_from_rows = 144

    def __init__(self, packed: torch.Tensor, scale_zeros: torch.Tensor, group: int, block: int,
                 bias: torch.Tensor | None):
        n = scale_zeros.shape[1]
        super().__init__(scale_zeros.shape[0] * group, n, bias)
        self.group, self.block = group, block
        self.register_buffer("packed", packed)
        self.register_buffer("scale_zeros", scale_zeros)
        if not block:
            self.dense_from_rows = 1 << 62

    def matmul(self, rows):
        return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, self.group, self.scale_zeros)

    def dense_matmul(self, rows):
        return F.linear(rows, self.dequantized())

    def dequantized(self) -> torch.Tensor:
        """The weight as bf16 [N, K] (what the kernel computes with, rounded to bf16)."""
        n, k, g = self.out_features, self.in_features, self.group
        codes = unpack_int4(self.packed, n, k, self.block).view(n, k // g, g)
        scale = self.scale_zeros[..., 0].T.float().contiguous()[..., None]      # [N, K/g, 1]
        offset = self.scale_zeros[..., 1].T.float().contiguous()[..., None] - 8 * scale
        return torch.addcmul(offset, codes.float(), scale).view(n, k).to(ACT_DTYPE)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", group={self.group}"


class FormatEmbedding(nn.Module):
    """Embedding rows read from a converted matrix: bf16 rows, or int8 rows times their scale.

    With tied embeddings it shares the head's tensors (no second copy)."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor | None, out_dtype: torch.dtype,
                 padding_idx: int | None = None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.out_dtype = out_dtype
        self.padding_idx = padding_idx
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(ids, self.weight).to(self.out_dtype)                 # [..., H]
        if self.scales is None:
            return rows
        return rows * F.embedding(ids, self.scales[:, None]).to(self.out_dtype)

    def extra_repr(self) -> str:
        kind = "int8" if self.scales is not None else str(self.weight.dtype).removeprefix("torch.")
        return f"{self.num_embeddings}, {self.embedding_dim}, weights={kind}"
