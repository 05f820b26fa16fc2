"""Reading safetensors checkpoints tensor by tensor with positional reads (no mmap).

Only the tensor asked for is read, into memory the caller owns: loading a model layer by
layer never holds (nor maps) the whole file, so a checkpoint larger than memory loads.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32,
          "I64": torch.int64, "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "BOOL": torch.bool,
          "F64": torch.float64}


@dataclass(slots=True, frozen=True)
class TensorEntry:
    """Where one tensor's bytes sit: file, absolute byte offset, length, dtype and shape."""

    path: Path
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def read_header(path: Path) -> tuple[dict, int]:
    """The JSON header of a safetensors file and the offset where its data begins."""
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    return header, 8 + length


class Checkpoint:
    """All tensors of a (possibly sharded) safetensors checkpoint directory, by name."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors files in {self.directory}")
        self.entries: dict[str, TensorEntry] = {}
        for path in files:
            header, base = read_header(path)
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                start, end = info["data_offsets"]
                self.entries[name] = TensorEntry(path, base + start, end - start, DTYPES[info["dtype"]],
                                                 tuple(info["shape"]))

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def read(self, name: str) -> torch.Tensor:
        """A fresh CPU tensor holding `name`."""
        entry = self.entries[name]
        out = torch.empty(entry.shape, dtype=entry.dtype)
        read_into(entry.path, entry.offset, out)
        return out

    def copy_into(self, name: str, out: torch.Tensor, chunk_bytes: int = 4 << 20) -> None:
        """Fill `out` (contiguous CPU, same shape) with `name`, converting dtype on the way.

        Same dtype: read straight into `out`. Otherwise the stored rows pass through a buffer of
        at most `chunk_bytes`, so loading an fp16 embedding as fp32 never holds a second full copy.
        """
        entry = self.entries[name]
        if tuple(out.shape) != entry.shape or not out.is_contiguous():
            raise ValueError(f"{name}: stored {entry.shape}, target {tuple(out.shape)} (contiguous needed)")
        if out.dtype == entry.dtype:
            read_into(entry.path, entry.offset, out)
            return
        flat = out.view(-1)
        item = torch.empty((), dtype=entry.dtype).element_size()
        step = max(1, chunk_bytes // item)
        buffer = torch.empty(min(step, flat.numel()), dtype=entry.dtype)
        for start in range(0, flat.numel(), step):
            piece = buffer[:min(step, flat.numel() - start)]
            read_into(entry.path, entry.offset + start * item, piece)
            flat[start:start + piece.numel()].copy_(piece)

    def digest(self) -> str:
        """Identity of the weights: names, shapes, dtypes and the first/last bytes of each tensor."""
        h = xxhash.xxh3_128()
        for name in sorted(self.entries):
            entry = self.entries[name]
            h.update(f"{name}:{entry.shape}:{entry.dtype}".encode())
            with open(entry.path, "rb") as handle:
                for offset in (entry.offset, max(entry.offset, entry.offset + entry.nbytes - 256)):
                    h.update(os.pread(handle.fileno(), min(256, entry.nbytes), offset))
        return h.hexdigest()


def read_into(path: Path, offset: int, out: torch.Tensor) -> int:
    """Fill the contiguous CPU tensor `out` with bytes of `path` from `offset`; return bytes read."""
    view = memoryview(out.view(-1).view(torch.uint8).numpy())
    fd = os.open(path, os.O_RDONLY)
    try:
        return pread_exact(fd, view, offset)
    finally:
        os.close(fd)


def pread_exact(fd: int, view: memoryview, offset: int) -> int:
    """Fill `view` from `fd` at `offset` with positional reads (no seek, thread-safe); raise on a short file."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise OSError(f"short read at offset {offset + done}")
        done += got
    return done
