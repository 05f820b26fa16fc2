"""Whether the native step runs a model here, and the choices it makes by CPU (native/decoder.py
takes them): float32 prompt chunks natively or on PyTorch's MKL loop, one-row attention's KV requests."""
from __future__ import annotations

import os

import torch

from ..model.arch import ModelAdapter
from . import abi, build
from ..weights.awq.linear import AWQLinear
from ..weights.formats import INT4_BLOCKS, INT4_GROUP, Int4Linear, Int8Linear
from .matrices import int4_readable, weights_kind

TILE, BLOCK = 16, 32                        # a packed matrix's rows and columns are multiples of these


PREFILL_ENV = "KVBOOST_NATIVE_PREFILL"      # "1" / "0": float32 prompt chunks natively or not, whatever the CPU
KV_AHEAD_ENV = "KVBOOST_NATIVE_KV_AHEAD"    # "1" / "0": one-row attention asks for KV rows ahead or not


def float_prefill_off() -> str | None:
    """Why a float32 model's prompt chunks take the PyTorch layer loop rather than the native step
    (None: natively). On Intel CPUs PyTorch's MKL float32 products run prompt chunks faster than
    the native step's FMA loops (1,000 tokens of the default model: 1.2 against 1.7-1.9 s on a
    2-core Xeon); elsewhere (MKL's AMD path, no MKL) the native step runs them. Decode steps of
    one or several sequences stay native. $KVBOOST_NATIVE_PREFILL=1 / 0 decides instead."""
    wanted = os.environ.get(PREFILL_ENV)
    if wanted in ("0", "1"):
        return None if wanted == "1" else f"{PREFILL_ENV}=0"
    if torch.backends.mkl.is_available() and build.cpu_vendor() == "GenuineIntel":
        return "float32 prompt chunks run PyTorch's MKL products (faster than the native step on Intel CPUs)"
    return None


def kv_ahead() -> bool:
    """Whether one-row attention (a row over its own KV: serial decode, unshared batches, long
    contexts) asks for the KV rows ahead of their use in every block (software prefetch; the same
    numbers either way). Yes except on AMD CPUs: on a 2-core Intel Xeon it made a 1-row step at a 1k
    context 24 % faster; on a 2-core AMD Zen 4 the hardware prefetchers alone stream the KV faster
    (the default int4 step 7-10 % faster at 1 row and 12-15 % at 8 rows with nothing shared without
    it, in paired runs), so there only runs of 64 keys or fewer, one query head per KV head and int8
    KV ask (decode.cpp attend_block). $KVBOOST_NATIVE_KV_AHEAD=1 / 0 decides instead. Rows that share a key
    block keep their requests (they pay there on both CPUs)."""
    wanted = os.environ.get(KV_AHEAD_ENV)
    if wanted in ("0", "1"):
        return wanted == "1"
    return build.cpu_vendor() != "AuthenticAMD"


def unsupported_reason(adapter: ModelAdapter) -> str | None:
    """Why the native step cannot run this model (None: it can)."""
    _, reason = adapter.plain_llama()
    if reason is not None:
        return reason
    if adapter.device.type != "cpu" or adapter.dtype != torch.float32:
        return f"needs float32 on CPU, the model is {adapter.dtype} on {adapter.device.type}"
    if adapter.geometry.dtype not in abi.KV_TYPES:
        return f"KV in {adapter.geometry.dtype} (the step reads float32, float16, bfloat16 or int8 KV)"
    if getattr(adapter.model, "kvboost_streamer", None) is not None:
        return "layers are streamed"
    kind = weights_kind(adapter)
    if kind is None:
        return _int4_layout_reason(adapter) or _awq_reason(adapter) or (
            'needs every decoder linear layer and the head in float32, or the layers in int4 and the '
            'head in int8 (weights="int4"), or the layers packed (PackedLinear) and the head packed or float32')
    for i in range(len(adapter.layers)):
        if kind == "int4" and any(m.out_features % TILE or m.in_features % BLOCK for m in adapter.layer_parts(i).linears):
            return "a layer's shape is not a multiple of 16 rows x 32 columns"
    head = adapter.lm_head
    if kind == "int4" and (head.out_features % TILE or head.in_features % BLOCK):
        return "the output head's shape is not a multiple of 16 rows x 32 columns"
    if len(set(adapter.layer_rope_kinds)) > 2:
        return "more than two rotary kinds"
    return None


def _int4_layout_reason(adapter: ModelAdapter) -> str | None:
    """For weights="int4" whose layers the step cannot read: which layer and why (the general reason
    said its layers were not int4, which they are)."""
    linears = [m for i in range(len(adapter.layers)) for m in adapter.layer_parts(i).linears]
    if not (all(type(m) is Int4Linear for m in linears) and type(adapter.lm_head) is Int8Linear):
        return None
    for m in (m for m in linears if not int4_readable(m)):        # matrices' rule; here, why not
        if not m.block:
            return (f"an int4 layer of {m.out_features} rows: PyTorch packed it in a layout the step does not "
                    f"read (it reads rows a multiple of {INT4_BLOCKS[0]} on every CPU)")
        return f"an int4 layer in groups of {m.group} (the step reads groups of {INT4_GROUP})"
    return None


def _awq_reason(adapter: ModelAdapter) -> str | None:
    """For an AWQ model some of whose layers run a PyTorch kernel: which and how the step would take them."""
    if getattr(adapter.model, "kvboost_awq", None) is None:
        return None
    linears = [m for i in range(len(adapter.layers)) for m in adapter.layer_parts(i).linears]
    dense = sum(type(m) is torch.nn.Linear for m in linears)
    if dense:
        return (f"the AWQ checkpoint keeps {dense} decoder linear layers unquantized (modules_to_not_convert): "
                "the step reads every decoder linear packed")
    layers = [m for m in linears if type(m) is AWQLinear]
    if not layers:
        return None
    kernels = ", ".join(sorted({m.layout.name for m in layers}))
    return (f"{len(layers)} AWQ layers run awq_kernel {kernels}: the step reads awq_kernel='native' (every layer "
            f"resident, in and out features multiples of {BLOCK} and {TILE}, groups a multiple of {BLOCK}; "
            f"the first: {layers[0].checkpoint_name}, {layers[0].out_features} x {layers[0].in_features} in groups of "
            f"{layers[0].group_size})")
