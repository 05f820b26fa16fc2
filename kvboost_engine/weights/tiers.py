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
import xxhash

from .checkpoint import TensorEntry, pread_exact, read_header


CONTENT = "content_xxh3"         # the pack's metadata key for its blobs' digest
_CHECKED: set[tuple] = set()     # pack files (path, mtime, size, inode) whose content was found whole


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
        try:
            pread_exact(self._fd, memoryview(out.numpy()), entry.offset)
        except OSError as err:                  # cut short or unreadable since the load
            raise OSError(err.errno, f"cannot read layer {layer} from the pack file {self.path} ({err.strerror or err}); "
                                     "it is written again on the next load") from err
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
    `sizes` beforehand, so no more than one blob is in memory at once. The blobs' xxh3 goes into the
    metadata (CONTENT, written over a placeholder of the same length once the data is out), so
    pack_file_ok finds a file whose bytes changed since. Written to a staging name (paths'
    STAGING_PREFIXES: a killed writer's file is pruned a day later) and renamed, so a reader never
    sees a partial file; a write that fails (a full disk) is an OSError naming the file.
    """
    def header_bytes(digest: str) -> bytes:
        header: dict = {"__metadata__": {**metadata, CONTENT: digest}}
        offset = 0
        for layer in sorted(sizes):
            header[f"layers.{layer}"] = {"dtype": "U8", "shape": [sizes[layer]], "data_offsets": [offset, offset + sizes[layer]]}
            offset += sizes[layer]
        raw = json.dumps(header).encode()
        raw += b" " * (-(8 + len(raw)) % 64)           # data starts 64-byte aligned
        return struct.pack("<Q", len(raw)) + raw

    tmp = path.with_name(f".pack-{path.name}.{os.getpid()}.tmp")
    digest = xxhash.xxh3_64()
    try:
        with open(tmp, "wb") as handle:
            placeholder = header_bytes("0" * 16)
            handle.write(placeholder)
            for layer, blob in blobs:
                if blob.numel() != sizes[layer]:
                    raise ValueError(f"layer {layer}: a blob of {blob.numel()} bytes, {sizes[layer]} announced")
                digest.update(memoryview(blob.numpy()))
                handle.write(memoryview(blob.numpy()))
            handle.seek(0)
            handle.write(header_bytes(digest.hexdigest()))      # the same length as the placeholder
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except OSError as err:                      # an interrupted write leaves nothing behind
        tmp.unlink(missing_ok=True)
        raise OSError(err.errno, f"cannot write the pack file {path} ({err.strerror or err}): free space there, "
                                 "set KVBOOST_HOME to another folder, or stream from RAM (stream_from='ram')") from err
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def pack_file_ok(path: Path, sizes: dict[int, int], metadata: dict[str, str]) -> bool:
    """Whether `path` is a whole pack file as write_pack_file(path, sizes, ..., metadata) writes it:
    its header readable, the same metadata and layer sizes, the file as long as they say and its
    blobs' xxh3 the one recorded (a file cut short, damaged since, or another one at the name is
    written again rather than failing or answering garbage mid-request). The content is read once
    per process and file version."""
    try:
        header, base = read_header(path)
        stat = path.stat()
        layers = {int(key.split(".")[1]): info["data_offsets"] for key, info in header.items() if key.startswith("layers.")}
        recorded = dict(header.get("__metadata__") or {})
        digest = recorded.pop(CONTENT, None)
        if not (recorded == metadata and {i: end - start for i, (start, end) in layers.items()} == sizes
                and stat.st_size >= base + max((end for _, end in layers.values()), default=0)):
            return False
        stamp = (str(path), stat.st_mtime_ns, stat.st_size, stat.st_ino)
        if stamp not in _CHECKED:
            if digest is None or _content_digest(path, base, layers) != digest:
                return False
            _CHECKED.add(stamp)
        return True
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError, struct.error):
        return False


def _content_digest(path: Path, base: int, layers: dict) -> str:
    digest = xxhash.xxh3_64()
    with open(path, "rb") as handle:
        for _, (start, end) in sorted(layers.items()):
            handle.seek(base + start)
            left = end - start
            while left:
                block = handle.read(min(left, 1 << 23))
                if not block:
                    raise OSError(f"{path} ends inside its data")
                digest.update(block)
                left -= len(block)
    return digest.hexdigest()


def fill(tier, layer: int, staging: torch.Tensor) -> torch.Tensor:
    """The layer's blob copied into `staging`; returns the filled part."""
    src = tier.source(layer, staging)
    out = staging[:src.numel()]
    if src.data_ptr() != out.data_ptr():
        out.copy_(src)
    return out
