"""Backing tiers for streamed layers: a file on disk, or host RAM.

Both hold one blob per streamed layer (see residency.LayerBinding) and can copy a layer's
blob into a staging buffer. The disk tier is a safetensors file with one uint8 tensor per
layer, read with positional reads: nothing of it is mapped, so only the staging slots count
toward the process's memory, however large the file.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

from .checkpoint import TensorEntry, pread_exact, read_header


class PackFileTier:
    """Layer blobs in a safetensors file (tensor `layers.{i}`), read with pread."""

    name = "disk"

    def __init__(self, path: Path):
        self._fd = -1
        self.path = Path(path)
        header, base = read_header(self.path)
        self.entries: dict[int, TensorEntry] = {}
        for key, info in header.items():
            if key.startswith("layers."):
                start, end = info["data_offsets"]
                self.entries[int(key.split(".")[1])] = TensorEntry(self.path, base + start, end - start,
                                                                   torch.uint8, (end - start,))
        self.metadata = header.get("__metadata__", {})
        self._fd = os.open(self.path, os.O_RDONLY)

    def nbytes(self, layer: int) -> int:
        return self.entries[layer].nbytes

    def source(self, layer: int, staging: torch.Tensor) -> torch.Tensor:
        """Read the layer's blob into `staging` (contiguous CPU, pinned on CUDA); return the filled part."""
        entry = self.entries[layer]
        out = staging[:entry.nbytes]
        pread_exact(self._fd, memoryview(out.numpy()), entry.offset)
        return out

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self):
        self.close()


class HostRamTier:
    """Layer blobs held in host RAM (pinned when the compute device is CUDA)."""

    name = "ram"

    def __init__(self, blobs: dict[int, torch.Tensor]):
        self.blobs = blobs

    def nbytes(self, layer: int) -> int:
        return self.blobs[layer].numel()

    def source(self, layer: int, staging: torch.Tensor) -> torch.Tensor:
        return self.blobs[layer]

    def close(self) -> None:
        pass


def write_pack_file(path: Path, sizes: dict[int, int], blobs, metadata: dict[str, str]) -> None:
    """Write a safetensors file of uint8 tensors `layers.{i}`, taking blobs one at a time.

    `blobs` yields (layer, uint8 tensor) in ascending layer order; the header is known from
    `sizes` beforehand, so no more than one blob is in memory at once. Written to a temporary
    name and renamed, so a reader never sees a partial file.
    """
    header: dict = {"__metadata__": metadata}
    offset = 0
    for layer in sorted(sizes):
        header[f"layers.{layer}"] = {"dtype": "U8", "shape": [sizes[layer]], "data_offsets": [offset, offset + sizes[layer]]}
        offset += sizes[layer]
    raw = json.dumps(header).encode()
    raw += b" " * (-(8 + len(raw)) % 64)           # data starts 64-byte aligned
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as handle:
            handle.write(struct.pack("<Q", len(raw)) + raw)
            for layer, blob in blobs:
                if blob.numel() != sizes[layer]:
                    raise ValueError(f"layer {layer}: a blob of {blob.numel()} bytes, {sizes[layer]} announced")
                handle.write(memoryview(blob.numpy()))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:                       # an interrupted write leaves nothing behind
        tmp.unlink(missing_ok=True)
        raise


def pack_file_ok(path: Path, sizes: dict[int, int], metadata: dict[str, str]) -> bool:
    """Whether `path` is a whole pack file as write_pack_file(path, sizes, ..., metadata) writes it:
    its header readable, the same metadata and layer sizes, and the file as long as they say (a file
    cut short, or another one at the name, is written again rather than failing mid-request)."""
    try:
        header, base = read_header(path)
        size = path.stat().st_size
        layers = {int(key.split(".")[1]): info["data_offsets"] for key, info in header.items() if key.startswith("layers.")}
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError, struct.error):
        return False
    return (header.get("__metadata__") == metadata and {i: end - start for i, (start, end) in layers.items()} == sizes
            and size >= base + max((end for _, end in layers.values()), default=0))


def fill(tier, layer: int, staging: torch.Tensor) -> torch.Tensor:
    """The layer's blob copied into `staging`; returns the filled part."""
    src = tier.source(layer, staging)
    out = staging[:src.numel()]
    if src.data_ptr() != out.data_ptr():
        out.copy_(src)
    return out
