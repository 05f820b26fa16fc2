"""The AWQ GEMM checkpoint format: its quantization_config and its 4-bit packing.

AutoAWQ's GEMM layout for a linear layer with `in_features` K and `out_features` N:

    qweight  int32 [K, N/8]      eight 4-bit weights per int32
    qzeros   int32 [K/group, N/8] eight 4-bit zero points per int32
    scales   fp16  [K/group, N]

Within each int32, nibble i (bits 4i..4i+3) holds column `8*c + AWQ_PACK_ORDER[i]` of its
group of eight columns. A weight dequantizes as `(q - zero) * scale` of its row's group.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import UnsupportedModelError

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# nibble that holds logical column j of a group of eight: the inverse permutation
AWQ_UNPACK_ORDER = tuple(AWQ_PACK_ORDER.index(j) for j in range(8))
PACK = 8            # 4-bit values per int32
SUPPORTED_VERSIONS = ("gemm",)


@dataclass(slots=True, frozen=True)
class AWQConfig:
    """The parts of a checkpoint's quantization_config that decide how to read it."""

    bits: int
    group_size: int
    zero_point: bool
    version: str
    modules_to_not_convert: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, quant: dict) -> "AWQConfig":
        """Read an AutoAWQ/transformers quantization_config; unsupported variants raise clearly."""
        method = str(quant.get("quant_method", "")).lower()
        if method != "awq":
            raise UnsupportedModelError(f"quantization method {method!r} is not AWQ")
        config = cls(
            bits=int(quant.get("bits", quant.get("w_bit", 0))),
            group_size=int(quant.get("group_size", quant.get("q_group_size", 0))),
            zero_point=bool(quant.get("zero_point", True)),
            version=str(quant.get("version", "gemm")).lower(),
            modules_to_not_convert=tuple(quant.get("modules_to_not_convert") or ()),
        )
        config.check()
        return config

    def check(self) -> None:
        if self.version not in SUPPORTED_VERSIONS:
            raise UnsupportedModelError(
                f"AWQ version {self.version!r} is not supported: kvboost reads the GEMM layout only "
                f"(qweight [in, out/8]); re-export the checkpoint with version='gemm'")
        if self.bits != 4:
            raise UnsupportedModelError(f"AWQ with {self.bits} bits is not supported (only 4-bit)")
        if not self.zero_point:
            raise UnsupportedModelError("AWQ without zero points is not supported (GEMM needs zero_point=True)")
        if self.group_size <= 0 or self.group_size % PACK:
            raise UnsupportedModelError(
                f"AWQ group size {self.group_size} is not supported (per-channel -1 is not; "
                f"use a positive multiple of 8 such as 64 or 128)")

    def to_dict(self) -> dict:
        """The quantization_config AutoAWQ writes for this configuration."""
        return {"quant_method": "awq", "bits": self.bits, "group_size": self.group_size,
                "zero_point": self.zero_point, "version": self.version,
                "modules_to_not_convert": list(self.modules_to_not_convert) or None}


def awq_config_of(config) -> AWQConfig | None:
    """The AWQConfig of an HF config (object or dict), None when it is not an AWQ checkpoint."""
    quant = config.get("quantization_config") if isinstance(config, dict) else getattr(
        config, "quantization_config", None)
    if quant is None:
        return None
    if not isinstance(quant, dict):
        quant = quant.to_dict()
    if str(quant.get("quant_method", "")).lower() != "awq":
        return None
    return AWQConfig.from_dict(quant)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """[R, C] integers in 0..15 -> int32 [R, C/8] in AWQ pack order."""
    rows, cols = values.shape
    if cols % PACK:
        raise ValueError(f"columns ({cols}) must be a multiple of {PACK} to pack")
    if values.numel() and (int(values.min()) < 0 or int(values.max()) > 15):
        raise ValueError("values to pack must lie in 0..15")
    groups = values.to(torch.int64).reshape(rows, cols // PACK, PACK)         # [R, C/8, 8]
    packed = torch.zeros(rows, cols // PACK, dtype=torch.int64)
    for nibble, column in enumerate(AWQ_PACK_ORDER):
        packed |= groups[:, :, column] << (4 * nibble)
    # reinterpret as signed 32-bit, as AutoAWQ stores it
    return (packed - ((packed >> 31) & 1) * (1 << 32)).to(torch.int32)


def unpack_int4(packed: torch.Tensor, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """int32 [R, C/8] in AWQ pack order -> [R, C] values in 0..15 (uint8, or `dtype`)."""
    shifts = torch.tensor([4 * n for n in AWQ_UNPACK_ORDER], dtype=torch.int32, device=packed.device)
    values = packed[:, :, None] >> shifts                                      # [R, C/8, 8]
    values &= 0xF                                                              # in place: one temporary
    return values.reshape(packed.shape[0], -1).to(dtype)


def dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight [K, N] (in x out, i.e. the transpose of nn.Linear.weight) of AWQ tensors."""
    q = unpack_int4(qweight).to(dtype)                                         # [K, N]
    zeros = unpack_int4(qzeros).to(dtype).repeat_interleave(group_size, 0)     # [K, N]
    return (q - zeros) * scales.to(dtype).repeat_interleave(group_size, 0)
