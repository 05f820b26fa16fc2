"""On-disk format of one KV entry: a fixed header, the token ids, the raw KV bytes.

    offset 0                   header, HEADER_SIZE bytes, little-endian (`_HEADER`)
    HEADER_SIZE                token ids: int32 little-endian, n_tokens of them
    HEADER_SIZE + 4 * n_tokens KV payload: the tensor's bytes in C order (bfloat16 as its
                               raw 2-byte patterns; numpy has no bfloat16)

The header's last field is an xxh3-128 checksum over the header bytes before it, the token
bytes and the payload. The file size must equal header + tokens + payload exactly, so a
truncated (or extended) file is rejected before anything large is allocated.
"""
from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from ...errors import InputError

MAGIC = b"KVBOOST\x00"
FORMAT_VERSION = 1
MAX_DIMS = 8
#  magic, version, header size, fingerprint, key, start, n_tokens, payload bytes,
#  dtype code, exact, ndim, (pad), shape[MAX_DIMS], checksum
_HEADER = struct.Struct(f"<8sII16s16sQQQBBB5x{MAX_DIMS}Q16s")
HEADER_SIZE = _HEADER.size
_CHECKED_HEADER = HEADER_SIZE - 16           # the checksum covers the header up to itself
_TOKEN = np.dtype("<i4")
_BLOCK = 8 << 20                             # bytes per read / write system call
DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4,
               torch.int8: 5, torch.uint8: 6}
_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


class CorruptEntry(Exception):
    """A file that must not be served: wrong magic/version/identity, bad sizes or checksum."""


@dataclass(frozen=True, slots=True)
class Entry:
    start: int
    tokens: tuple[int, ...]
    kv: torch.Tensor
    exact: bool


def check_payload(tokens, kv: torch.Tensor) -> torch.Tensor:
    """Validate an entry's token ids and tensor (InputError); returns `kv` as a contiguous CPU tensor."""
    if kv.dtype not in DTYPE_CODES or not 1 <= kv.dim() <= MAX_DIMS:
        raise InputError(f"disk tier stores 1-{MAX_DIMS} dim tensors of {sorted(map(str, DTYPE_CODES))}, "
                         f"got {kv.dtype} with {kv.dim()} dims")
    if any(not 0 <= t < 2**31 for t in tokens):
        raise InputError("token ids must be in [0, 2**31)")
    return kv.detach().to("cpu").contiguous()


def entry_size(n_tokens: int, kv: torch.Tensor) -> int:
    """Bytes of the file holding `n_tokens` token ids and `kv`."""
    return HEADER_SIZE + n_tokens * _TOKEN.itemsize + kv.numel() * kv.element_size()


def raw_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor as a flat uint8 array (a view, no copy)."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


def write_entry(fd: int, fingerprint: bytes, key: bytes, start: int, tokens, kv: torch.Tensor,
                exact: bool) -> int:
    """Write one entry to the open file `fd` (at its current position); returns bytes written.

    `kv` must be a contiguous CPU tensor of a dtype in DTYPE_CODES with at most MAX_DIMS dims.
    """
    token_raw = np.asarray(tokens, dtype=_TOKEN).tobytes()
    payload = raw_bytes(kv)
    shape = tuple(kv.shape) + (0,) * (MAX_DIMS - kv.dim())
    fields = (MAGIC, FORMAT_VERSION, HEADER_SIZE, fingerprint, key, start, len(tokens),
              payload.nbytes, DTYPE_CODES[kv.dtype], int(exact), kv.dim(), *shape)
    head = _HEADER.pack(*fields, b"\0" * 16)[:_CHECKED_HEADER]
    hasher = xxhash.xxh3_128(head)
    hasher.update(token_raw)
    hasher.update(memoryview(payload))
    _write_all(fd, memoryview(head + hasher.digest() + token_raw))
    _write_all(fd, memoryview(payload))
    return HEADER_SIZE + len(token_raw) + payload.nbytes


def check_header(fd: int, file_size: int, fingerprint: bytes, key: bytes) -> tuple[bytes, tuple]:
    """Read and check the header alone (magic, identity, fields, and that the file is exactly
    as long as the header says); returns (header bytes, parsed fields). Raises CorruptEntry."""
    if file_size < HEADER_SIZE:
        raise CorruptEntry(f"file of {file_size} bytes is shorter than the header")
    head = os.pread(fd, HEADER_SIZE, 0)
    if len(head) != HEADER_SIZE:
        raise CorruptEntry("short header read")
    return head, _parse_header(head, file_size, fingerprint, key)


def read_entry(fd: int, file_size: int, fingerprint: bytes, key: bytes) -> Entry:
    """Read and verify the entry in `fd`; raises CorruptEntry if anything is off. Nothing past the
    header is read (or allocated) unless the header checks out and matches the file's size."""
    head, (start, n_tokens, shape, dtype, exact, checksum) = check_header(fd, file_size, fingerprint, key)
    hasher = xxhash.xxh3_128(head[:_CHECKED_HEADER])
    token_raw = bytearray(n_tokens * _TOKEN.itemsize)
    _read_into(fd, memoryview(token_raw), HEADER_SIZE, hasher)
    kv = torch.empty(shape, dtype=dtype)
    _read_into(fd, memoryview(raw_bytes(kv)), HEADER_SIZE + len(token_raw), hasher)
    if hasher.digest() != checksum:
        raise CorruptEntry("checksum mismatch")
    tokens = tuple(np.frombuffer(token_raw, dtype=_TOKEN).tolist())
    return Entry(start, tokens, kv, exact)


def _parse_header(head: bytes, file_size: int, fingerprint: bytes, key: bytes):
    """Check every header field against what the file must be; returns the parsed values."""
    (magic, version, header_size, file_fingerprint, file_key, start, n_tokens, payload_bytes,
     dtype_code, exact, ndim, *rest) = _HEADER.unpack(head)
    dims, checksum = rest[:MAX_DIMS], rest[MAX_DIMS]
    if magic != MAGIC or version != FORMAT_VERSION or header_size != HEADER_SIZE:
        raise CorruptEntry(f"bad magic/version ({magic!r}, {version}, {header_size})")
    if file_fingerprint != fingerprint or file_key != key:
        raise CorruptEntry("fingerprint or key differs from the file name's")
    dtype = _DTYPES.get(dtype_code)
    if dtype is None or exact > 1 or not 1 <= ndim <= MAX_DIMS or any(dims[ndim:]):
        raise CorruptEntry(f"bad dtype/exact/shape fields ({dtype_code}, {exact}, {ndim}, {dims})")
    shape = tuple(dims[:ndim])
    if payload_bytes != math.prod(shape) * dtype.itemsize:
        raise CorruptEntry(f"payload of {payload_bytes} bytes does not fit shape {shape}")
    if file_size != HEADER_SIZE + n_tokens * _TOKEN.itemsize + payload_bytes:
        raise CorruptEntry(f"file size {file_size} differs from what the header describes")
    return start, n_tokens, shape, dtype, bool(exact), checksum


def _write_all(fd: int, view: memoryview) -> None:
    done = 0
    while done < len(view):
        done += os.write(fd, view[done:done + _BLOCK])


def _read_into(fd: int, view: memoryview, offset: int, hasher) -> None:
    """Fill `view` from `fd` at `offset` block by block, hashing each block while it is warm."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:done + _BLOCK]], offset + done)
        if got <= 0:
            raise CorruptEntry(f"file ended at offset {offset + done}")
        hasher.update(view[done:done + got])
        done += got
