"""Open and check a GGUF file before anything is allocated: truncation, unknown or inexact tensor
types, unsupported architectures and missing tensors are refused with the tensor or type named.

`GGUFFile` memory-maps the file (gguf.GGUFReader, copy-on-write: pages are read on first touch,
nothing is copied) and checks every tensor's type id and extent while the reader lists them;
`check_gguf` adds the model-level checks a load needs; `gguf_weight_bytes` is what the tensors
occupy as stored (the figure a "does it fit" check compares with the memory available).

Standalone for now: the default loading path (loading.py) still converts a GGUF with transformers.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from ..errors import InputError, ModelNotFoundError, UnsupportedModelError
from ..model.arch import SUPPORTED_ARCHITECTURES
from .gguf_blocks import EXACT_TYPES, GGUFTensor

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


def _check_tensor_info(field, data_start: int, file_bytes: int) -> None:
    """Refuse one tensor-info entry (name, dims, type id, offset) before the reader maps its data."""
    _name_len, name_data, _n_dims, dims, raw_type, offset = field.parts
    name = bytes(name_data).decode("utf-8", "replace")
    type_id = int(raw_type[0])
    if type_id not in gguf.GGMLQuantizationType._value2member_map_:
        raise InputError(f"tensor {name}: unknown tensor type id {type_id} "
                         "(a corrupt file, or a type newer than the installed gguf package)")
    kind = gguf.GGMLQuantizationType(type_id)
    block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    dims = [int(d) for d in dims]
    if dims and dims[0] % block:
        raise InputError(f"tensor {name}: rows of {dims[0]} values are not whole {kind.name} blocks "
                         f"of {block}")
    nbytes = int(np.prod(dims)) * block_bytes // block
    end = data_start + int(offset[0]) + nbytes
    if end > file_bytes:
        raise InputError(f"tensor {name} ({kind.name}, {nbytes} bytes) ends at byte {end} but the file has "
                         f"{file_bytes} bytes: the file is truncated")


class _CheckedReader(gguf.GGUFReader):
    """GGUFReader that checks each tensor's type id and extent before it maps the tensor."""

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        for field in fields:
            _check_tensor_info(field, start_offs, len(self.data))
        super()._build_tensors(start_offs, fields)


class GGUFFile:
    """A GGUF file's metadata and tensors (memory-mapped, as stored).

    tensors: name -> GGUFTensor (PyTorch shape, type name, bytes, the raw mapped data)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelNotFoundError(f"GGUF file {self.path} does not exist")
        try:
            reader = _CheckedReader(self.path, "c")
        except InputError as err:
            raise InputError(f"{self.path}: {err}") from None
        except (ValueError, IndexError, KeyError, OverflowError, TypeError) as err:
            raise InputError(f"{self.path} is not a readable GGUF file (truncated or corrupt: {err})") from None
        self._reader = reader
        self.tensors = {t.name: GGUFTensor(t.name, t.tensor_type.name, tuple(int(d) for d in reversed(t.shape.tolist())),
                                           int(t.n_bytes), t.data) for t in reader.tensors}

    def field(self, key: str, default=None):
        """A metadata value (str, number or list), or `default` when the file lacks the key."""
        found = self._reader.get_field(key)
        return default if found is None else found.contents()

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
    needed += [f"blk.{i}.{part}.weight" for i in range(layers) for part in REQUIRED_BLOCK_TENSORS[arch]]
    missing = [name for name in needed if name not in file.tensors]
    if missing:
        raise InputError(f"{file.path} lacks tensor {missing[0]} ({len(missing)} missing in all), "
                         f"which a {arch} GGUF of {layers} layers needs")
    return layers


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
