"""Compute layouts for 4-bit AWQ weights: how they sit in memory and how a matmul reads them.

A layout turns the checkpoint's tensors (qweight, qzeros, scales) into its own tensors once,
at load time; the same bytes are what layer streaming moves. Four layouts:

- `native`: the native step's tiles (a PackedLinear per layer, every layer resident; the CPU
  default where the native step runs: int8 activations per block of 32, the same numbers
  whatever rows share a step, so reuse is token-exact).
- `cpu-int4pack`: PyTorch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`, bf16 activations).
- `awq-ext`: AutoAWQ's CUDA kernels (`awq_ext`, the optional `[awq-cuda]` extra), AWQ tensors as is.
- `dequant`: any device; AWQ tensors as is, dequantized to the activation dtype per matmul.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...errors import InputError
from ..packed import BLOCK, TILE, PackedLinear, pack_codes
from .format import dequantize, unpack_int4


@dataclass(slots=True, frozen=True)
class TensorSpec:
    """Name, shape and dtype of one tensor a layout keeps for a linear layer."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * torch.empty((), dtype=self.dtype).element_size()


class DequantLayout:
    """Keeps the AWQ tensors; each matmul dequantizes the weight to the activation dtype."""

    name = "dequant"

    def specs(self, k: int, n: int, group: int) -> list[TensorSpec]:
        return [TensorSpec("qweight", (k, n // 8), torch.int32),
                TensorSpec("qzeros", (k // group, n // 8), torch.int32),
                TensorSpec("scales", (k // group, n), torch.float16)]

    def prepare(self, qweight, qzeros, scales, group: int) -> dict[str, torch.Tensor]:
        return {"qweight": qweight.contiguous(), "qzeros": qzeros.contiguous(),
                "scales": scales.to(torch.float16).contiguous()}

    def matmul(self, x: torch.Tensor, t: dict[str, torch.Tensor], group: int) -> torch.Tensor:
        # x [M, K] -> [M, N]
        weight = dequantize(t["qweight"], t["qzeros"], t["scales"], group, dtype=x.dtype)  # [K, N]
        return x @ weight


class CpuInt4PackLayout:
    """PyTorch's CPU int4 kernel: weights repacked for it, scale and float zero in bf16.

    The kernel computes `w = (q - 8) * scale + zero_f`; AWQ's `(q - z) * scale` is the same
    with `zero_f = (8 - z) * scale`. It runs with bf16 activations (its fp32 path is slow).
    """

    name = "cpu-int4pack"

    def specs(self, k: int, n: int, group: int) -> list[TensorSpec]:
        return [TensorSpec("packed", (n, k // 2), torch.uint8),
                TensorSpec("scale_zeros", (k // group, n, 2), torch.bfloat16)]

    def prepare(self, qweight, qzeros, scales, group: int) -> dict[str, torch.Tensor]:
        q = unpack_int4(qweight, torch.int32).T.contiguous()                      # [N, K]
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)        # [N, K/2] uint8
        scale = scales.float()                                                    # [K/g, N]
        zero_f = (8 - unpack_int4(qzeros).float()) * scale
        scale_zeros = torch.stack([scale, zero_f], dim=-1).to(torch.bfloat16).contiguous()
        return {"packed": packed, "scale_zeros": scale_zeros}

    def matmul(self, x: torch.Tensor, t: dict[str, torch.Tensor], group: int) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(torch.bfloat16), t["packed"], group, t["scale_zeros"])           # [M, N] bf16
        return out.to(x.dtype)

    @staticmethod
    def supports(k: int, n: int, group: int) -> bool:
        return group in (32, 64, 128, 256) and k % group == 0 and n % 16 == 0


class NativeLayout:
    """The native step's layout (weights/packed.py): per row and block of 32 columns, d = the AWQ
    scale (in its own dtype) and m = -zero * scale (float32: an exact product for a float16 or
    bfloat16 scale), so w = q * d + m is AWQ's (q - zero) * scale with one rounding. The layers
    become PackedLinear modules at load, every one resident (the step reads them in place; streamed
    layers take the other layouts), and the native step computes with int8 activations per block."""

    name = "native"

    def prepare(self, qweight, qzeros, scales, group: int) -> dict[str, torch.Tensor]:
        q = unpack_int4(qweight).T.contiguous()                                   # [N, K] uint8
        per = group // BLOCK
        d = scales.T.repeat_interleave(per, dim=1)                                # [N, K/32]
        m = (unpack_int4(qzeros).float() * scales.float()).neg_().T.repeat_interleave(per, dim=1)
        return pack_codes(q, d, m, 4, scale_dtype=scales.dtype, offset_dtype=torch.float32)

    def module(self, tensors: dict[str, torch.Tensor], k: int, n: int, bias) -> PackedLinear:
        return PackedLinear(tensors["codes"], tensors["d"], tensors["m"], 4, n, k, bias=bias)

    @staticmethod
    def supports(k: int, n: int, group: int) -> bool:
        return n % TILE == 0 and k % BLOCK == 0 and group % BLOCK == 0


class AwqExtLayout:
    """AutoAWQ's CUDA GEMM kernels (package `autoawq-kernels`, extra `[awq-cuda]`); AWQ tensors as
    stored, fp16 activations. Same dispatch as AutoAWQ: GEMM kernel for small batches, dequantize
    and a dense matmul from 1024 rows on. Not exercised by CI (no GPU there)."""

    name = "awq-ext"

    def __init__(self):
        self._ext = importlib.import_module("awq_ext")

    specs = DequantLayout.specs
    prepare = DequantLayout.prepare

    def matmul(self, x: torch.Tensor, t: dict[str, torch.Tensor], group: int) -> torch.Tensor:
        if x.shape[0] >= 1024:   # large prefill: dequantize once, then a dense matmul (as AutoAWQ does)
            weight = self._ext.dequantize_weights_cuda(t["qweight"], t["scales"], t["qzeros"], 0, 0, 0, False)
            return (x.half() @ weight).to(x.dtype)
        out = self._ext.gemm_forward_cuda(x.half(), t["qweight"], t["scales"], t["qzeros"], 8)
        return out.to(x.dtype)


KERNELS = ("native", "dequant", "cpu-int4pack", "awq-ext")


def select_layout(device: torch.device, kernel: str | None = None, native: bool = False):
    """The best layout for `device`: a named one when `kernel` is given, else probed.

    CPU: `native` where `native` says the native step can take the model (it runs on this
    machine, float32, every layer resident: the loader's call), else `cpu-int4pack` when PyTorch
    has the op and it passes a small self-check, else `dequant`. CUDA: `awq-ext` when AutoAWQ's
    kernels import, else `dequant`. A named kernel that does not exist, cannot run on `device` or
    is not installed: InputError.
    """
    if kernel is not None and kernel not in KERNELS:
        raise InputError(f"unknown awq_kernel {kernel!r} (one of {', '.join(KERNELS)})")
    if kernel == "native" and device.type != "cpu":
        raise InputError(f"awq_kernel='native' runs on the CPU, not on {device}")
    if kernel == "native" or (kernel is None and native and device.type == "cpu"):
        return NativeLayout()
    if kernel == "cpu-int4pack" and device.type != "cpu":
        raise InputError(f"awq_kernel='cpu-int4pack' runs on the CPU, not on {device}")
    if kernel == "awq-ext" and device.type != "cuda":
        raise InputError(f"awq_kernel='awq-ext' runs on CUDA, not on {device}")
    if kernel == "dequant":
        return DequantLayout()
    if kernel == "cpu-int4pack" or (kernel is None and device.type == "cpu"):
        if cpu_int4pack_works():
            return CpuInt4PackLayout()
        if kernel is not None:
            raise InputError("awq_kernel='cpu-int4pack': the CPU int4 kernel is not available in this PyTorch build")
        return DequantLayout()
    if kernel == "awq-ext" or (kernel is None and device.type == "cuda"):
        try:
            return AwqExtLayout()
        except ImportError as err:
            if kernel is not None:
                raise InputError(f"awq_kernel='awq-ext' needs AutoAWQ's kernels (pip install .[awq-cuda]): {err}") from err
            return DequantLayout()
    return DequantLayout()


def torch_cpu_layout(k: int, n: int, group: int):
    """PyTorch's kernel for one CPU layer: cpu-int4pack where it reads the shape and passes its
    self-check, else dequant (where the native layout is not taken)."""
    layout = select_layout(torch.device("cpu"))
    return layout if not isinstance(layout, CpuInt4PackLayout) or layout.supports(k, n, group) else DequantLayout()


_PROBE: dict[str, bool] = {}


def cpu_int4pack_works() -> bool:
    """Whether PyTorch's CPU int4 kernel exists and agrees with plain dequantization."""
    if "cpu" not in _PROBE:
        _PROBE["cpu"] = _probe_cpu_int4pack()
    return _PROBE["cpu"]


def _probe_cpu_int4pack() -> bool:
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return False
    gen = torch.Generator().manual_seed(0)
    k, n, group = 128, 64, 64
    qweight = torch.randint(-2**31, 2**31 - 1, (k, n // 8), generator=gen, dtype=torch.int64).to(torch.int32)
    qzeros = torch.randint(-2**31, 2**31 - 1, (k // group, n // 8), generator=gen, dtype=torch.int64).to(torch.int32)
    scales = (torch.rand(k // group, n, generator=gen) * 0.05 + 0.01).half()
    x = torch.randn(3, k, generator=gen)
    try:
        layout = CpuInt4PackLayout()
        got = layout.matmul(x, layout.prepare(qweight, qzeros, scales, group), group)
    except (RuntimeError, NotImplementedError):
        return False
    want = F.linear(x.bfloat16().float(), dequantize(qweight, qzeros, scales, group).T)
    return bool(torch.allclose(got.float(), want, rtol=0.03, atol=0.05))


def _numel(shape) -> int:
    total = 1
    for dim in shape:
        total *= dim
    return total
