"""A safetensors file read one tensor at a time, each tensor's pages dropped after use.

safetensors' own reader maps the whole file and leaves every page it read resident: converting a
3.4 GB bf16 checkpoint that way ends with 3.4 GB of file pages counted in the process's memory.
Here the file is mapped copy-on-write, a tensor is copied out as float32 (`read`), and its pages
are handed back (MADV_DONTNEED; the page cache keeps the file). The format: an 8-byte little-endian
header size, a JSON header {name: {dtype, shape, data_offsets}}, then the data.
"""
from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import torch

from ..errors import InputError

_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


class SafetensorsFile:
    """names(): the tensor names; read(name): that tensor as a float32 copy, its pages released."""

    def __init__(self, path: Path):
        self.path = Path(path)
        with open(self.path, "rb") as handle:
            self._mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
        try:
            (size,) = struct.unpack("<Q", self._mapped[:8])
            header = json.loads(bytes(self._mapped[8:8 + size]))
        except (struct.error, ValueError) as err:
            raise InputError(f"{self.path}: not a safetensors file ({err})") from None
        header.pop("__metadata__", None)
        self._start, self._header = 8 + size, header

    def names(self) -> list[str]:
        return list(self._header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._header[name].get("shape") or ())

    def read(self, name: str) -> torch.Tensor:
        entry = self._header[name]
        begin, end = (self._start + offset for offset in entry["data_offsets"])
        dtype = _DTYPES.get(entry["dtype"])
        if dtype is None or end > len(self._mapped):
            raise InputError(f"{self.path}: tensor {name} ({entry['dtype']}) cannot be read")
        count = (end - begin) // torch.empty(0, dtype=dtype).element_size()
        view = torch.frombuffer(self._mapped, dtype=dtype, count=count, offset=begin) if count else \
            torch.empty(0, dtype=dtype)
        out = view.reshape(entry["shape"]).float()
        del view
        page = mmap.PAGESIZE
        first = begin // page * page
        self._mapped.madvise(mmap.MADV_DONTNEED, first, min(-(-end // page) * page, len(self._mapped)) - first)
        return out
