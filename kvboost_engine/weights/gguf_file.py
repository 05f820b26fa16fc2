"""Open and check a GGUF file before anything is allocated: truncation, unknown or inexact tensor
types, unsupported architectures and missing tensors are refused with the tensor or type named.

`GGUFFile` memory-maps the file (copy-on-write: pages are read on first touch, nothing is copied),
parses its header (gguf_header.py) and checks every tensor's type id and extent;
`check_gguf` adds the model-level checks a load needs; `gguf_weight_bytes` is what the tensors
occupy as stored (the figure a "does it fit" check compares with the memory available).

Standalone for now: the default loading path (loading.py) still converts a GGUF with transformers.
"""
from __future__ import annotations

import math
import mmap
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from ..errors import InputError, ModelNotFoundError, UnsupportedModelError
from ..model.arch import SUPPORTED_ARCHITECTURES
from .gguf_blocks import EXACT_TYPES, GGUFTensor
from .gguf_header import TensorInfo, read_header

# GGUF general.architecture -> HF model_type. llama.cpp writes Mistral (7B, Nemo) as "llama".
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
                      "gemma3": "gemma3_text"}

_LLAMA_BLOCK = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
# per GGUF architecture: the .weight tensors every block must have (biases and output.weight optional)
REQUIRED_BLOCK_TENSORS = {
    "llama": _LLAMA_BLOCK,
    "qwen2": _LLAMA_BLOCK,
    "qwen3": _LLAMA_BLOCK + ("attn_q_norm", "attn_k_norm"),
    "phi3": ("attn_norm", "attn_qkv", "attn_output", "ffn_norm", "ffn_up", "ffn_down"),
    "gemma3": _LLAMA_BLOCK + ("attn_q_norm", "attn_k_norm", "post_attention_norm", "post_ffw_norm"),
}
REQUIRED_MODEL_TENSORS = ("token_embd.weight", "output_norm.weight")


def _tensor(info: TensorInfo, mapped, data_start: int, alignment: int) -> GGUFTensor:
    """One tensor's type and extent checked, its bytes as a view of the mapping [*rows, row bytes]."""
    if info.type_id not in {kind.value for kind in gguf.GGMLQuantizationType}:
        raise InputError(f"tensor {info.name}: unknown tensor type id {info.type_id} "
                         "(a corrupt file, or a type newer than the installed gguf package)")
    kind = gguf.GGMLQuantizationType(info.type_id)
    block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    columns = info.dims[0] if info.dims else 1
    if columns % block:
        raise InputError(f"tensor {info.name}: rows of {columns} values are not whole {kind.name} blocks of {block}")
    if info.offset % alignment:
        raise InputError(f"tensor {info.name}: data offset {info.offset} is not aligned to {alignment} (corrupt header)")
    nbytes = math.prod(info.dims) * block_bytes // block                   # Python ints: no overflow
    start = data_start + info.offset
    if start + nbytes > len(mapped):
        raise InputError(f"tensor {info.name} ({kind.name}, {nbytes} bytes) ends at byte {start + nbytes} but the "
                         f"file has {len(mapped)} bytes: the file is truncated")
    shape = tuple(reversed(info.dims))                                      # PyTorch order
    raw = np.frombuffer(mapped, np.uint8, nbytes, start).reshape(*shape[:-1], columns // block * block_bytes)
    return GGUFTensor(info.name, kind.name, shape, nbytes, raw)


class GGUFFile:
    """A GGUF file's metadata and tensors (memory-mapped copy-on-write, as stored: nothing is read
    until a tensor is used).

    fields: metadata key -> value; tensors: name -> GGUFTensor (PyTorch shape, type name, bytes)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelNotFoundError(f"GGUF file {self.path} does not exist")
        try:
            with open(self.path, "rb") as handle:
                mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
        except (ValueError, OSError) as err:                                # an empty file cannot be mapped
            raise InputError(f"{self.path} is not a readable GGUF file: {err}") from None
        try:
            header = read_header(mapped)
            self.tensors = {t.name: _tensor(t, mapped, header.data_start, header.alignment) for t in header.tensors}
        except InputError as err:
            raise InputError(f"{self.path}: {err}") from None
        self.fields = header.fields
        self._mapped = mapped

    def release(self, tensor: GGUFTensor) -> None:
        """Drop the pages of a tensor read once (a repack): they leave this process's resident memory
        (the file's copy stays in the page cache). Reading the tensor again reads the file again."""
        start = tensor.raw.ctypes.data - np.frombuffer(self._mapped, np.uint8, 1).ctypes.data
        page = mmap.PAGESIZE
        first, end = start // page * page, -(-(start + tensor.nbytes) // page) * page
        self._mapped.madvise(mmap.MADV_DONTNEED, first, min(end, len(self._mapped)) - first)

    def field(self, key: str, default=None):
        """A metadata value (int, float, str, a numpy array or list), or `default` when absent."""
        return self.fields.get(key, default)

    @property
    def architecture(self) -> str:
        """general.architecture as the file writes it ("llama", "qwen2", "gemma3", ...)."""
        arch = self.field("general.architecture")
        if not isinstance(arch, str):
            raise InputError(f"{self.path} has no general.architecture")
        return arch

    def weight_bytes(self) -> int:
        """Bytes every tensor occupies as stored."""
        return sum(t.nbytes for t in self.tensors.values())


@dataclass(frozen=True, slots=True)
class GGUFSummary:
    """What check_gguf found: a loadable GGUF model."""

    architecture: str           # as the file writes it
    model_type: str             # the HF model_type it loads as
    layers: int
    weight_bytes: int           # as stored
    types: dict                 # tensor type name -> how many tensors


def _model_type(arch: str) -> str:
    model_type = GGUF_ARCHITECTURES.get(arch)
    if model_type not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(a for a, m in GGUF_ARCHITECTURES.items() if m in SUPPORTED_ARCHITECTURES)
        raise UnsupportedModelError(f"GGUF architecture {arch!r} is not supported (supported: {supported})")
    return model_type


def _check_types(file: GGUFFile) -> None:
    for tensor in file.tensors.values():
        if tensor.type_name not in EXACT_TYPES:
            raise UnsupportedModelError(f"type {tensor.type_name} of tensor {tensor.name} has no exact repack yet "
                                        f"(supported: {', '.join(EXACT_TYPES)})")


def _check_tensors_present(file: GGUFFile, arch: str) -> int:
    layers = file.field(f"{arch}.block_count")
    if not isinstance(layers, int) or layers < 1:
        raise InputError(f"{file.path} has no {arch}.block_count (the number of layers)")
    needed = list(REQUIRED_MODEL_TENSORS)
    needed += [f"blk.{i}.{part}.weight" for i in range(layers) for part in REQUIRED_BLOCK_TENSORS.get(arch, _LLAMA_BLOCK)]
    missing = [name for name in needed if name not in file.tensors]
    if missing:
        raise InputError(f"{file.path} lacks tensor {missing[0]} ({len(missing)} missing in all), "
                         f"which a {arch} GGUF of {layers} layers needs")
    beyond = sorted(k for k in file.tensors if k.startswith("blk.") and k.split(".")[1].isdigit()
                    and int(k.split(".")[1]) >= layers)
    if beyond:                          # a truncated model would load and answer garbage (llama.cpp refuses too)
        raise InputError(f"{file.path} has tensors of layers past its {arch}.block_count of {layers} "
                         f"({beyond[0]}...): its metadata and tensors disagree")
    return layers


def check_gguf_tensors(path: str | Path) -> None:
    """The tensor checks of `check_gguf` (every tensor the architecture needs is there, none of a layer
    past block_count), for the float32 conversion too: transformers fills a missing tensor with random
    values and drops extra layers, and the conversion would be cached. Reads the header only."""
    file = GGUFFile(path)
    _check_tensors_present(file, file.architecture)


def check_gguf(path: str | Path) -> GGUFSummary:
    """Refuse a GGUF that kvboost cannot load exactly, before anything is allocated: a truncated or
    corrupt file, an unknown or not exactly repacked tensor type, an unsupported architecture or a
    missing tensor (each error names the tensor or type). Reads the header only."""
    file = GGUFFile(path)
    arch = file.architecture
    model_type = _model_type(arch)
    _check_types(file)
    layers = _check_tensors_present(file, arch)
    types = dict(Counter(t.type_name for t in file.tensors.values()))
    return GGUFSummary(arch, model_type, layers, file.weight_bytes(), types)


def gguf_weight_bytes(path: str | Path) -> int:
    """Bytes a GGUF's tensors occupy as stored: what its quantized weights need in memory."""
    return GGUFFile(path).weight_bytes()
