"""A file of named tensors written one at a time and mapped back without a copy (the repack cache).

`PackWriter` appends each tensor as it is made (64-byte aligned) and keeps only its index, so
writing a model's repacked weights holds one tensor in memory at a time; `finish` writes the index
(JSON: name -> dtype, shape, offset, plus free-form metadata) beside the data. `read_pack` checks the
data file against the index's checksum (xxh3, ~0.1 s a GB from the page cache) and maps it
copy-on-write: every tensor is a view of the mapping, read from disk on first touch and
never copied (its pages are the page cache's, shared with other processes mapping the same file).
"""
from __future__ import annotations

import ctypes
import json
import mmap
import os
from pathlib import Path

import torch
import xxhash

from ..errors import InputError

ALIGN = 64
FORMAT = "kvboost-pack-1"
_DTYPES = {str(t).removeprefix("torch."): t for t in (torch.uint8, torch.int8, torch.int16, torch.int32,
                                                    torch.float16, torch.bfloat16, torch.float32)}


class PackWriter:
    """Append tensors to `data` (a path); `finish(meta)` writes `index` and closes."""

    def __init__(self, data: Path, index: Path):
        self.data, self.index = data, index
        self._out = open(data, "wb")
        self._entries: dict[str, dict] = {}
        self._hash = xxhash.xxh3_64()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._entries:
            raise ValueError(f"tensor {name} written twice")
        tensor = tensor.detach().contiguous()
        pad = -self._out.tell() % ALIGN
        self._write(b"\0" * pad)
        offset = self._out.tell()
        self._write(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
        self._entries[name] = {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
                               "offset": offset}

    def _write(self, chunk: bytes) -> None:
        self._out.write(chunk)
        self._hash.update(chunk)

    def finish(self, meta: dict) -> None:
        self._out.flush()
        os.fsync(self._out.fileno())
        self._out.close()
        self.index.write_text(json.dumps({"format": FORMAT, "bytes": self.data.stat().st_size, "meta": meta,
                                          "xxh3_64": self._hash.hexdigest(), "tensors": self._entries}))

    def close(self) -> None:
        if not self._out.closed:
            self._out.close()


def read_pack(data: Path, index: Path) -> tuple[dict[str, torch.Tensor], dict, tuple[int, int]]:
    """(name -> tensor viewing the mapped file, meta, the mapping's address range). InputError for a
    file that does not match its index."""
    try:
        info = json.loads(index.read_text())
    except (OSError, ValueError) as err:
        raise InputError(f"{index}: unreadable repack index ({err})") from None
    if info.get("format") != FORMAT or data.stat().st_size != info.get("bytes"):
        raise InputError(f"{data}: not the file its index {index.name} describes (format or size differ)")
    with open(data, "rb") as handle:
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY) if info["bytes"] else None
    if mapped is not None and xxhash.xxh3_64_hexdigest(mapped) != info.get("xxh3_64"):
        raise InputError(f"{data}: checksum differs from its index (the file changed after it was written)")
    start = ctypes.addressof(ctypes.c_char.from_buffer(mapped)) if mapped is not None else 0
    tensors = {}
    for name, entry in info["tensors"].items():
        dtype = _DTYPES[entry["dtype"]]
        count = 1
        for size in entry["shape"]:
            count *= size
        if count == 0:
            tensors[name] = torch.empty(entry["shape"], dtype=dtype)
            continue
        flat = torch.frombuffer(mapped, dtype=dtype, count=count, offset=entry["offset"])
        tensors[name] = flat.view(entry["shape"])
    return tensors, info["meta"], (start, start + info["bytes"])


def mapped_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes of the distinct tensors (a tied tensor counted once)."""
    seen, total = set(), 0
    for tensor in tensors.values():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total
