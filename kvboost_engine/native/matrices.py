"""How each weight kind becomes the native step's matrix arguments (abi.MatArgs dicts): the int4
layers and int8 head of weights="int4" repacked into the kernel's tiles, a PackedLinear and a float32
linear read in place; which kind a model is; and whether its input embedding can be decoded from
its packed head (kvb_decoder_embed)."""
from __future__ import annotations

import torch

from ..model.arch import ModelAdapter
from ..weights.formats import INT4_GROUP, Int4Linear, Int8Linear, unpack_int4
from ..weights.packed import BLOCK, PackedEmbedding, PackedLinear, pack_codes


# A weight is (code - zero) * d + m (abi.MatArgs): the int4 layers keep their bf16 zeros as m (w =
# (q - 8) * scale + zero), the int8 head stores no m (w = (q - 128) * scale). The step reads the
# codes and d (and the int4 zeros) only, and computes code 0's value m - zero * d: an exact product
# and one rounding, the float32 offset zero - 8 * scale the PyTorch path computes.
def _int4_parts(module: Int4Linear) -> tuple:
    n, k = module.out_features, module.in_features
    codes = unpack_int4(module.packed, n, k, module.block)
    scale = module.scale_zeros[..., 0].T                                        # [N, K/g] bf16
    return codes, scale, module.scale_zeros[..., 1].T                           # zeros [N, K/g] bf16


def _int8_parts(module: Int8Linear) -> tuple:
    n, k = module.out_features, module.in_features
    codes = (module.qweight.to(torch.int16) + 128).to(torch.uint8)
    return codes, module.scales[:, None].expand(n, k // BLOCK), None


def joined(modules: list, bits: int) -> dict:
    """Several linear layers over the same input as one matrix (rows stacked), packed, with bias."""
    parts = [_int4_parts(m) if bits == 4 else _int8_parts(m) for m in modules]
    codes, scale = (torch.cat([p[i] for p in parts]) for i in range(2))
    offset = torch.cat([p[2] for p in parts]) if bits == 4 else None
    packed = pack_codes(codes, scale, offset, bits, offset_dtype=torch.bfloat16)
    packed["zero"] = 8 if bits == 4 else 128
    if any(m.bias is not None for m in modules):
        packed["bias"] = torch.cat([m.bias.float() if m.bias is not None else torch.zeros(m.out_features)
                                    for m in modules])
    packed["dims"] = (sum(m.out_features for m in modules), modules[0].in_features, bits)
    return packed


def weights_kind(adapter: ModelAdapter) -> str | None:
    """"int4" (decoder layers int4, head int8), "packed" (every decoder linear a PackedLinear, read in
    place, and the head one too or float32: AWQ's), "float" (all plain float32 linears), or None."""
    linears = [m for i in range(len(adapter.layers)) for m in adapter.layer_parts(i).linears]
    if all(type(m) is PackedLinear for m in linears) and (type(adapter.lm_head) is PackedLinear
                                                          or _float32(adapter.lm_head)):
        return "packed"
    if all(int4_readable(m) for m in linears) and type(adapter.lm_head) is Int8Linear:
        return "int4"
    if all(_float32(m) for m in [*linears, adapter.lm_head]):
        return "float"
    return None


def _float32(module) -> bool:
    return type(module) is torch.nn.Linear and module.weight.dtype == torch.float32


def head_matrix(kind: str, head) -> dict:
    """The output head's matrix arguments for a model of weights_kind `kind`."""
    if kind == "int4":
        return joined([head], 8)
    return packed(head) if type(head) is PackedLinear else float_matrix(head)


def int4_readable(module) -> bool:
    """Whether the step reads this layer as weights="int4" (PyTorch's pack layout it knows, its groups)."""
    return type(module) is Int4Linear and bool(module.block) and module.group == INT4_GROUP


ABSENT = {"dims": (0, 0, 0)}                 # stacked into the matrix before it


def packed(module: PackedLinear) -> dict:
    """A PackedLinear as it is: its own codes, d, m (d2, m2), bias (already the kernel's tiles; no copy); m
    is not read where it is -zero_code * d (Q4_0, Q5_0, Q8_0, re-quantized), and is the value of
    code m_code where the module has one (weights="int4": the step computes m - m_code * d)."""
    zero = getattr(module, "zero_code", None)           # m == -zero * d: the step derives it
    return {"codes": module.codes, "d": module.d, "m": None if zero else module.m, "bias": module.bias,
            "d2": getattr(module, "d2", None), "m2": getattr(module, "m2", None),
            "zero": zero or getattr(module, "m_code", 0), "dims": (module.out_features, module.in_features, module.bits)}


def float_matrix(module: torch.nn.Linear) -> dict:
    """A float32 linear layer as it is: its own weight [N, K] (no copy), and bias."""
    return {"codes": module.weight, "bias": None if module.bias is None else module.bias.float(),
            "dims": (module.out_features, module.in_features, 32)}


def embeds_from_head(adapter: ModelAdapter, kind: str) -> bool:
    """Whether the native side can look up the input embeddings: a packed model whose embedding is
    its head's table as it is (no scale, float32 out), with bf16 / fp16 scales or a K-quant's two
    levels (code * d exact in float32, or Q6_K's (code - 32) * d: one rounding either way; kvb_decoder_embed)."""
    embed, head = adapter.embed, adapter.lm_head
    return (kind == "packed" and isinstance(embed, PackedEmbedding) and embed.table is head
            and embed.embed_scale is None and embed.out_dtype == torch.float32
            and head.d.dtype in (torch.bfloat16, torch.float16, torch.uint8, torch.int8))
