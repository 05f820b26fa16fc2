"""The header of a GGUF file (version 2 or 3, little-endian): metadata and tensor infos, parsed from a
memory map with every read checked against the end of the file.

gguf.GGUFReader builds a numpy view per metadata element (about 5 s for the default model's
49152-token vocabulary, 2 cores); this reads the same header in a fraction of that and refuses a
cut or corrupt header with the byte it needed. Tensor data is not touched here.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from ..errors import InputError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_ARRAY_DEPTH = 8        # arrays of arrays (llama.cpp writes none nested; a few levels allowed)
MAX_DIMS = 4                    # GGML_MAX_DIMS
STRING, ARRAY = 8, 9
# GGUF metadata value type -> struct format character (little-endian, standard sizes; numpy reads the same)
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor-info entry: dims as GGUF lists them ([columns, rows, ...]), the type id, the
    offset of its data from the start of the data section."""

    name: str
    dims: tuple[int, ...]
    type_id: int
    offset: int


@dataclass(frozen=True, slots=True)
class Header:
    version: int
    fields: dict                # key -> value (int, float, bool, str, a numpy array or a list)
    tensors: list               # TensorInfo, in file order
    data_start: int             # byte where the tensor data section begins (aligned)
    alignment: int


class _Cursor:
    """Reads little-endian values from a buffer, refusing any read past its end."""

    def __init__(self, buf):
        self.buf, self.pos, self.size = buf, 0, len(buf)

    def need(self, n: int, what: str) -> int:
        start, end = self.pos, self.pos + n
        if n < 0 or end > self.size:
            raise InputError(f"the header is cut: {what} needs bytes {start}..{end} but the file has "
                             f"{self.size} bytes (truncated or corrupt)")
        self.pos = end
        return start

    def unpack(self, fmt: str, what: str):
        start = self.need(struct.calcsize(fmt), what)
        return struct.unpack_from(fmt, self.buf, start)[0]

    def string(self, what: str) -> str:
        length = self.unpack("<Q", what)
        start = self.need(length, what)
        return bytes(self.buf[start:start + length]).decode("utf-8", "replace")

    def value(self, type_id: int, what: str, depth: int = 0):
        if type_id == STRING:
            return self.string(what)
        if type_id in SCALARS:
            return self.unpack("<" + SCALARS[type_id], what)
        if type_id == ARRAY:
            if depth >= MAX_ARRAY_DEPTH:         # llama.cpp's files nest none; a hostile one could recurse away
                raise InputError(f"{what} nests arrays more than {MAX_ARRAY_DEPTH} deep (corrupt header)")
            item_type, count = self.unpack("<I", what), self.unpack("<Q", what)
            if item_type in SCALARS:
                dtype = np.dtype("<" + SCALARS[item_type])
                start = self.need(count * dtype.itemsize, what)
                return np.frombuffer(self.buf, dtype, count, start)
            return [self.value(item_type, what, depth + 1) for _ in range(count)]
        raise InputError(f"{what} has unknown value type {type_id} (corrupt header)")


def _tensor_info(cursor: _Cursor, index: int) -> TensorInfo:
    name = cursor.string(f"tensor info {index}")
    n_dims = cursor.unpack("<I", f"tensor {name}")
    if n_dims > MAX_DIMS:
        raise InputError(f"tensor {name} has {n_dims} dims (at most {MAX_DIMS}): corrupt header")
    dims = tuple(cursor.unpack("<Q", f"tensor {name}") for _ in range(n_dims))
    type_id = cursor.unpack("<I", f"tensor {name}")
    return TensorInfo(name, dims, type_id, cursor.unpack("<Q", f"tensor {name}"))


def read_header(buf) -> Header:
    """Parse the header of a GGUF file held in `buf` (a memory map or bytes)."""
    cursor = _Cursor(buf)
    magic = bytes(buf[cursor.need(4, "the magic"):4])
    if magic != GGUF_MAGIC:
        raise InputError(f"not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")
    version = cursor.unpack("<I", "the version")
    if version not in (2, 3):
        raise InputError(f"GGUF version {version} is not supported (2 and 3 are; a big-endian file reads "
                         "as a huge version)")
    tensor_count, kv_count = cursor.unpack("<Q", "the tensor count"), cursor.unpack("<Q", "the metadata count")
    fields = {}
    for index in range(kv_count):
        key = cursor.string(f"metadata key {index}")
        if key in fields:
            raise InputError(f"the file gives metadata key {key!r} twice (corrupt header)")
        fields[key] = cursor.value(cursor.unpack("<I", key), key)
    tensors = [_tensor_info(cursor, index) for index in range(tensor_count)]
    if len({t.name for t in tensors}) != len(tensors):
        raise InputError("the file names a tensor twice (corrupt header)")
    alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, (int, np.integer)) or isinstance(alignment, bool):
        raise InputError(f"general.alignment must be an integer, got {type(alignment).__name__} (corrupt header)")
    alignment = int(alignment)
    if alignment <= 0 or alignment & (alignment - 1):
        raise InputError(f"general.alignment {alignment} is not a power of two")
    data_start = -(-cursor.pos // alignment) * alignment
    return Header(version, fields, tensors, data_start, alignment)


def read_architecture(buf) -> str | None:
    """general.architecture from the metadata before it in `buf` (the start of a GGUF file), without
    the rest of the header: llama.cpp writes that key first. None where `buf` ends before it."""
    try:
        cursor = _Cursor(buf)
        if bytes(buf[cursor.need(4, "the magic"):4]) != GGUF_MAGIC or cursor.unpack("<I", "the version") not in (2, 3):
            return None
        cursor.unpack("<Q", "the tensor count")
        for index in range(cursor.unpack("<Q", "the metadata count")):
            key = cursor.string(f"metadata key {index}")
            value = cursor.value(cursor.unpack("<I", key), key)
            if key == "general.architecture":
                return value if isinstance(value, str) else None
    except InputError:
        return None
    return None
