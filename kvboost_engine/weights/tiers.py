"""Backing tiers for streamed layers: a file on disk, or host RAM.

Both hold one blob per streamed layer (see residency.LayerBinding) and can copy a layer's
blob into a staging buffer. The disk tier is a safetensors file with one uint8 tensor per
layer, read with positional reads: nothing of it is mapped, so only the staging slots count
toward the process's memory, however large the file.
"""
from __future__ import annotations

import errno
import json
import os
import struct
from pathlib import Path

import torch
import xxhash

from .checkpoint import TensorEntry, pread_exact, read_header


CONTENT = "layers_xxh3"          # the pack's metadata key for its blobs' digests (a JSON map: layer -> xxh3)
_CHECKED: dict[tuple, set] = {}  # pack files (path, mtime, size, inode) -> the layers found whole
_STORAGE_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}


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
            raise OSError(*((err.errno,) if err.errno is not None else ()),
                          f"cannot read layer {layer} from the pack file {self.path} ({err.strerror or err}); "
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
    `sizes` beforehand, so no more than one blob is in memory at once. Each blob's xxh3 goes into the
    metadata (CONTENT, a JSON map written over a placeholder of the same length once the data is out),
    so pack_file_ok finds a layer whose bytes changed since. Written to a staging name (paths'
    STAGING_PREFIXES: a killed writer's file is pruned a day later) and renamed, so a reader never
    sees a partial file; a write the storage refuses (a full disk, a read-only folder) is an OSError
    naming the file and what to do.
    """
    def header_bytes(digests: dict[int, str]) -> bytes:
        header: dict = {"__metadata__": {**metadata, CONTENT: json.dumps({str(i): d for i, d in digests.items()})}}
        offset = 0
        for layer in sorted(sizes):
            header[f"layers.{layer}"] = {"dtype": "U8", "shape": [sizes[layer]], "data_offsets": [offset, offset + sizes[layer]]}
            offset += sizes[layer]
        raw = json.dumps(header).encode()
        raw += b" " * (-(8 + len(raw)) % 64)           # data starts 64-byte aligned
        return struct.pack("<Q", len(raw)) + raw

    tmp = path.with_name(f".pack-{path.name}.{os.getpid()}.tmp")
    digests = {layer: "0" * 16 for layer in sorted(sizes)}     # xxh3 hex digests: always 16 characters
    try:
        with open(tmp, "wb") as handle:
            handle.write(header_bytes(digests))
            for layer, blob in blobs:
                if blob.numel() != sizes[layer]:
                    raise ValueError(f"layer {layer}: a blob of {blob.numel()} bytes, {sizes[layer]} announced")
                digests[layer] = xxhash.xxh3_64_hexdigest(memoryview(blob.numpy()))
                handle.write(memoryview(blob.numpy()))
            handle.seek(0)
            handle.write(header_bytes(digests))                 # the same length as the placeholder
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except OSError as err:                      # an interrupted write leaves nothing behind
        tmp.unlink(missing_ok=True)
        if err.errno not in _STORAGE_ERRORS:     # a checkpoint read that failed, ...: as it is
            raise
        raise OSError(err.errno, f"cannot write the pack file {path} ({err.strerror or err}): free space there, "
                                 "set KVBOOST_HOME to another folder, or stream from RAM (stream_from='ram')") from err
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def pack_file_ok(path: Path, sizes: dict[int, int], metadata: dict[str, str], layers=None) -> bool:
    """Whether `path` is a whole pack file as write_pack_file(path, sizes, ..., metadata) writes it:
    its header readable, the same metadata and layer sizes, the file as long as they say and the
    xxh3 of each of `layers` (default: all; a load checks those it streams) the one recorded (a file
    cut short, damaged since, or another one at the name is written again rather than failing or
    answering garbage mid-request). A layer's bytes are read once per process and file version."""
    try:
        header, base = read_header(path)
        stat = path.stat()
        extents = {int(key.split(".")[1]): info["data_offsets"] for key, info in header.items() if key.startswith("layers.")}
        recorded = dict(header.get("__metadata__") or {})
        digests = json.loads(recorded.pop(CONTENT, "{}"))
        if not (recorded == metadata and {i: end - start for i, (start, end) in extents.items()} == sizes
                and stat.st_size >= base + max((end for _, end in extents.values()), default=0)):
            return False
        checked = _CHECKED.setdefault((str(path), stat.st_mtime_ns, stat.st_size, stat.st_ino), set())
        for layer in sorted(set(extents if layers is None else layers) - checked):
            start, end = extents[layer]
            if digests.get(str(layer)) != _layer_digest(path, base + start, end - start):
                return False
            checked.add(layer)
        return True
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError, struct.error):
        return False


def _layer_digest(path: Path, offset: int, length: int) -> str:
    digest = xxhash.xxh3_64()
    with open(path, "rb") as handle:
        handle.seek(offset)
        while length:
            block = handle.read(min(length, 1 << 23))
            if not block:
                raise OSError(f"{path} ends inside its data")
            digest.update(block)
            length -= len(block)
    return digest.hexdigest()


def fill(tier, layer: int, staging: torch.Tensor) -> torch.Tensor:
    """The layer's blob copied into `staging`; returns the filled part."""
    src = tier.source(layer, staging)
    out = staging[:src.numel()]
    if src.data_ptr() != out.data_ptr():
        out.copy_(src)
    return out
