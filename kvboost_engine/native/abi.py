"""The C structures of decode.cpp's interface, field for field (ctypes lays them out as the C
compiler does): a model is a ModelArgs holding one LayerArgs per layer, each holding its matrices as
MatArgs; a step is an array of Row. Pointers are raw addresses of tensors the caller keeps alive."""
from __future__ import annotations

import ctypes

import torch

P, I32, I64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
SCALE_TYPES = {torch.bfloat16: 0, torch.int16: 0, torch.float16: 1, torch.float32: 2,   # decode.cpp ScaleType
               torch.uint8: 4,                    # S_U8: times a float16 super-block scale (d2 / m2)
               torch.int8: 5}                     # S_I8: 6-bit codes' scale per 16 columns, times d2
KV_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int8: 3}   # decode.cpp KvType
ACTS = {"silu": 0, "gelu_pytorch_tanh": 1}                        # decode.cpp Act: the MLP's activation
NO_M = 3                                                         # ScaleType S_NONE: m not stored
MATRICES = ("q", "k", "v", "o", "gate", "up", "down")


class MatArgs(ctypes.Structure):
    """One weight matrix: codes (4- or 8-bit tiles, or float32 rows when bits is 32), per-row-block
    scale d and offset m (d_type / m_type: ScaleType), bias or null. A weight is (code - zero) * d
    + m, m null: 0 (zero a power of two then). rows 0: absent (stacked into the matrix before it).
    d2 / m2: where d / m are uint8 (a K-quant's sub-block scales), or d int8 (6-bit codes, Q6_K: a
    scale per 16 columns), their float16 super-block scales, one per 8 blocks, else null."""
    _fields_ = [("codes", P), ("d", P), ("m", P), ("bias", P), ("d2", P), ("m2", P),
                ("rows", I32), ("cols", I32), ("bits", I32), ("d_type", I32), ("m_type", I32), ("zero", I32)]


class LayerArgs(ctypes.Structure):
    """One decoder layer: its two RMSNorm weights (before attention, before the MLP), seven
    matrices, sliding window (0: none); the RMSNorm weights over each query and key head before the
    rotary (Qwen3, Gemma 3; 0: none), over the attention's and the MLP's outputs before their
    residual adds (Gemma 3; 0: none); which rotary of the row it takes (0: cos / sin, 1: cos2 / sin2)."""
    _fields_ = [("in_norm", P), ("post_norm", P), *((name, MatArgs) for name in MATRICES), ("window", I64),
                ("q_norm", P), ("k_norm", P), ("attn_norm", P), ("mlp_norm", P), ("rope", I64)]


class ModelArgs(ctypes.Structure):
    """The whole model: sizes, the KV's element type (KV_TYPES), the MLP's activation (ACTS), whether
    one-row attention asks for KV rows ahead (kv_ahead: decoder.kv_ahead), norm epsilon and attention
    scaling, the layers, final norm and head."""
    _fields_ = [("layers", I32), ("hidden", I32), ("heads", I32), ("kv_heads", I32), ("head_dim", I32),
                ("inter", I32), ("vocab", I32), ("exact_top", I32), ("threads", I32), ("kv_type", I32),
                ("act", I32), ("kv_ahead", I32), ("eps", ctypes.c_float), ("scaling", ctypes.c_float),
                ("stack", ctypes.POINTER(LayerArgs)), ("final_norm", P), ("head", MatArgs)]


class Row(ctypes.Structure):
    """One token of a step: its sequence's KV ([2, layers, kv_heads, slots, head_dim]-shaped with
    element strides st [4]), slot of every position, its position, rotary cos / sin at it, whether
    its logits are wanted, and the second rotary's cos / sin at it (layers with rope 1)."""
    _fields_ = [("kv", P), ("st", P), ("slots", P), ("pos", I64), ("cos", P), ("sin", P), ("want", I64),
                ("cos2", P), ("sin2", P)]


def mat_args(mat: dict, hold) -> MatArgs:
    """A matrix as decoder.py describes it ({"codes", "d", "m", "bias", "d2", "m2", "zero", "dims":
    (rows, cols, bits)}; m absent or None: not stored; d2 / m2 only with uint8 / int8 d, uint8 m;
    hold(tensor) -> its address, kept alive)."""
    ptrs = [hold(mat[key]) if mat.get(key) is not None else 0 for key in ("codes", "d", "m", "bias", "d2", "m2")]
    d_type = SCALE_TYPES[mat["d"].dtype] if mat.get("d") is not None else 2
    m_type = SCALE_TYPES[mat["m"].dtype] if mat.get("m") is not None else NO_M
    zero = int(mat.get("zero") or 0)
    for scale, whole in (("d", "d2"), ("m", "m2")):
        two_level = mat.get(scale) is not None and mat[scale].dtype in (torch.uint8, torch.int8)
        if two_level != (mat.get(whole) is not None):
            raise ValueError(f"uint8 / int8 {scale} goes with its float16 super-block scales {whole}, and only it")
    if d_type == 5 and (mat["dims"][2] != 6 or m_type != NO_M or zero != 32):
        raise ValueError("int8 d (Q6_K: a scale per 16 columns) takes 6-bit codes, no m and zero code 32")
    if (d_type == 4) != (m_type == 4) or (d_type == 4 and mat["dims"][1] % (8 * 32)):
        raise ValueError("uint8 d and uint8 m go together, over columns in whole super-blocks of 256")
    if mat["dims"][2] in (4, 6, 8) and mat.get("m") is None and (zero <= 0 or zero & (zero - 1)):
        raise ValueError(f"a matrix without m needs a zero code that is a power of two (got {zero})")
    return MatArgs(*ptrs, *mat["dims"], d_type, m_type, zero)
