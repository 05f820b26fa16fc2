"""Reading safetensors checkpoints tensor by tensor with positional reads (no mmap).

Only the tensor asked for is read, into memory the caller owns: loading a model layer by
layer never holds (nor maps) the whole file, so a checkpoint larger than memory loads.
"""
from __future__ import annotations

import contextlib
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
        if length > os.fstat(handle.fileno()).st_size - 8:          # garbage: not a length to read
            raise ValueError(f"{path}: a header of {length} bytes in a file of {os.fstat(handle.fileno()).st_size}")
        header = json.loads(handle.read(length))
    return header, 8 + length


class Checkpoint:
    """All tensors of a (possibly sharded) safetensors checkpoint directory, by name."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors files in {self.directory}")
        self.files = files
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

    def digest(self, cache_dir: Path | None = None) -> str:
        """Full content hash (xxh3-128, hex) of the checkpoint's safetensors files: every byte of
        their headers and tensors. With `cache_dir`, remembered there per file identity (resolved
        path, size, mtime of every file), so a checkpoint is read for it once, not at every load."""
        identity = xxhash.xxh3_64_hexdigest("\n".join(
            f"{p.resolve()}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in self.files).encode())
        cached = Path(cache_dir) / "digests" / f"{identity}.xxh3" if cache_dir is not None else None
        if cached is not None:
            try:
                known = cached.read_text().strip()
                if len(known) == 32:
                    return known
            except OSError:
                pass
        h = xxhash.xxh3_128()
        for path in self.files:
            h.update(f"{path.name}\n".encode())
            hash_file(path, h)
        digest = h.hexdigest()
        if cached is not None:
            _write_quietly(cached, digest)
        return digest


def hash_file(path: Path, hasher, block_bytes: int = 8 << 20) -> None:
    """Feed every byte of `path` to `hasher`, a block at a time (one reusable buffer)."""
    buffer = bytearray(block_bytes)
    view = memoryview(buffer)
    with open(path, "rb") as handle:
        while True:
            got = handle.readinto(buffer)
            if not got:
                return
            hasher.update(view[:got])


def _write_quietly(path: Path, text: str) -> None:
    """Write a small cache file atomically; a cache that cannot be written is only slower."""
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temp.write_text(text)
        os.replace(temp, path)
    except OSError:
        with contextlib.suppress(OSError):
            temp.unlink(missing_ok=True)


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
