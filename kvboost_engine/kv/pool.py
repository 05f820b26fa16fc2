"""The KV block pool: fixed-size blocks preallocated up to a byte budget, shared by reference.

Storage is one tensor `[2, layers, kv_heads, slots, row_width]` (kv/element.py); block b owns slots
[b * block_tokens, (b + 1) * block_tokens). Consecutive block ids are consecutive slots, so a
run of consecutive blocks is read by attention as a plain view, without copying.

The pool is the one owner of block accounting: each block has one reference count, split by
holder kind: CACHED (chunks of the chunk cache) and IN_USE (running sequences, lookups handed
to a request, pending disk writes). A block is free when both are zero; it can be freed by
evicting cached chunks only when nothing but the cache holds it. `usage()` answers "what does
this pool hold, and for whom".

With a spill file, blocks past the RAM budget live in a memory-mapped file (the disk tier's
directory): a sequence longer than the RAM budget still runs, its oldest blocks paged by the
OS instead of held in anonymous memory.
"""
from __future__ import annotations

import errno
import os
import tempfile
import threading
import weakref

import numpy as np
import torch

from ..errors import BudgetError
from .geometry import KVGeometry

CACHED, IN_USE = 0, 1          # holder kinds of a block reference


class BlockPool:
    def __init__(self, geometry: KVGeometry, budget_bytes: int, device, *, block_tokens: int = 16,
                 spill_dir: str | None = None, spill_bytes: int = 0, pin_memory: bool = False):
        self.geometry = geometry
        self.block_tokens = block_tokens
        self.block_bytes = block_tokens * geometry.bytes_per_token
        self.ram_blocks = budget_bytes // self.block_bytes
        self.spill_blocks = spill_bytes // self.block_bytes if spill_dir else 0
        g, b = geometry, block_tokens
        self.ram = torch.empty(2, g.num_layers, g.kv_heads, max(self.ram_blocks, 1) * b, g.row_width,
                               dtype=g.dtype, device=device, pin_memory=pin_memory)
        self.spill, self._spill_fd = (_spill_tensor(spill_dir, self.spill_blocks, geometry, b) if self.spill_blocks
                                      else (None, None))
        self._spill_reserved = False    # the spill file's disk space, taken when a block first lands there
        self._close_spill = weakref.finalize(self, os.close, self._spill_fd) if self._spill_fd is not None else None
        # (the file, and its space, goes with the pool, or with free_storage())
        total = self.ram_blocks + self.spill_blocks
        self.refs = np.zeros((2, total), dtype=np.int64)        # [holder kind, block]
        self._lock = threading.RLock()
        self.peak_used = 0

    # ---- allocation ---------------------------------------------------------------------
    @property
    def total_blocks(self) -> int:
        return self.ram_blocks + self.spill_blocks

    def free_blocks(self) -> int:
        with self._lock:
            return int(self._free_mask().sum())

    def free_ram_blocks(self) -> int:
        """Free blocks in RAM (those past ram_blocks live in the spill file)."""
        with self._lock:
            return int(self._free_mask()[:self.ram_blocks].sum())

    def used_blocks(self) -> int:
        with self._lock:
            return self.total_blocks - int(self._free_mask().sum())

    def _free_mask(self) -> np.ndarray:
        return (self.refs[CACHED] == 0) & (self.refs[IN_USE] == 0)

    def allocate(self, count: int) -> list[int]:
        """`count` free blocks with one IN_USE reference each, consecutive where possible (RAM first)."""
        if count == 0:
            return []
        with self._lock:
            free = np.flatnonzero(self._free_mask())
            if len(free) < count:
                raise BudgetError(
                    f"the KV pool needs {count * self.block_bytes} more bytes ({count} blocks of "
                    f"{self.block_tokens} tokens) but only {len(free) * self.block_bytes} are free "
                    f"(pool: {self.total_blocks * self.block_bytes} bytes)")
            chosen = _consecutive_first(free, count, self.ram_blocks)
            if not self._spill_reserved and int(chosen.max()) >= self.ram_blocks:
                self._reserve_spill()
            self.refs[IN_USE, chosen] = 1
            self.peak_used = max(self.peak_used, self.total_blocks - int(self._free_mask().sum()))
            return chosen.tolist()

    def _reserve_spill(self) -> None:
        """Give the (sparse) spill file its disk space before its first block is used: a page of a
        mapped file that the disk cannot hold kills the process on its first write (SIGBUS), so a
        disk without the room refuses the request here instead (nothing allocated)."""
        size = self.spill.numel() * self.spill.element_size()
        reserve = getattr(os, "posix_fallocate", None)
        if reserve is None:             # (macOS) no way to reserve: the file stays sparse
            self._spill_reserved = True
            return
        try:
            disk = os.fstatvfs(self._spill_fd)
            if disk.f_bavail * disk.f_frsize < size:    # before glibc's fallback could fill the disk with zeros
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            reserve(self._spill_fd, 0, size)
        except OSError as err:
            raise BudgetError(f"the KV spill file cannot get its {size} bytes of disk ({err.strerror or err}); "
                              "this request needs more KV than the RAM pool holds") from err
        self._spill_reserved = True

    def retain(self, blocks, holder: int = IN_USE) -> None:
        if len(blocks):
            with self._lock:
                np.add.at(self.refs[holder], np.asarray(blocks, dtype=np.int64), 1)

    def release(self, blocks, holder: int = IN_USE) -> None:
        if len(blocks):
            with self._lock:
                np.subtract.at(self.refs[holder], np.asarray(blocks, dtype=np.int64), 1)
                assert (self.refs[holder] >= 0).all(), "block released more often than retained"

    def only_cached(self, blocks=None) -> np.ndarray:
        """Bool mask (over `blocks`, or every block): held by cached chunks and by nothing else."""
        with self._lock:
            refs = self.refs if blocks is None else self.refs[:, np.asarray(blocks, dtype=np.int64)]
            return (refs[CACHED] > 0) & (refs[IN_USE] == 0)

    def cached_refs(self) -> np.ndarray:
        """A copy of the CACHED reference counts (for invariant checks)."""
        with self._lock:
            return self.refs[CACHED].copy()

    def usage(self) -> dict:
        """Blocks by holder: cached (by chunks), in use (by running requests; overlaps cached where a
        request maps cached blocks), only cached (evictable), free."""
        with self._lock:
            cached, in_use = self.refs[CACHED] > 0, self.refs[IN_USE] > 0
            return {"cached": int(cached.sum()), "in_use": int(in_use.sum()),
                    "only_cached": int((cached & ~in_use).sum()), "free": int(self._free_mask().sum())}

    def free_storage(self) -> None:
        """Give back the pool's memory and its spill file (mapping, descriptor, disk space) for good:
        its engine closed, no block is read or written again."""
        with self._lock:
            self.ram, self.spill = self.ram.new_empty(0), None
            self.ram_blocks = self.spill_blocks = 0         # memory() and stats() count none any more
            self.refs = self.refs[:, :0]
            if self._close_spill is not None:
                self._close_spill()             # once: the finalizer does not close the number again

    # ---- data ---------------------------------------------------------------------------
    def region(self, block: int) -> tuple[torch.Tensor, int]:
        """(storage tensor, first slot) of a block."""
        if block < self.ram_blocks:
            return self.ram, block * self.block_tokens
        return self.spill, (block - self.ram_blocks) * self.block_tokens

    def runs(self, blocks: list[int], length: int) -> list[tuple[torch.Tensor, int, int, int]]:
        """Cover positions [0, length) of a block table as runs (tensor, slot, position, count)."""
        runs: list[tuple[torch.Tensor, int, int, int]] = []
        b = self.block_tokens
        for index, block in enumerate(blocks[:(length + b - 1) // b]):
            if block is None:                   # not part of this table (e.g. before a moved source span)
                continue
            tensor, slot = self.region(block)
            count = min(b, length - index * b)
            last = runs[-1] if runs else None
            if (last is not None and last[0] is tensor and last[1] + last[3] == slot and last[3] % b == 0
                    and last[2] + last[3] == index * b):
                runs[-1] = (tensor, last[1], last[2], last[3] + count)
            else:
                runs.append((tensor, slot, index * b, count))
        return runs

    def read(self, blocks: list[int], start: int, count: int) -> torch.Tensor:
        """KV of positions [start, start + count) of a block table: [2, layers, kv_heads, count, D] (a copy)."""
        parts = [tensor[:, :, :, slot + max(0, start - pos):slot + min(n, start + count - pos)]
                 for tensor, slot, pos, n in self.runs(blocks, start + count) if pos + n > start]
        return torch.cat(parts, dim=3) if len(parts) > 1 else parts[0].clone()

    def write(self, blocks: list[int], start: int, kv: torch.Tensor) -> None:
        """Store `kv` [2, layers, kv_heads, n, D] at positions start.. of a block table."""
        end = start + kv.shape[3]
        for tensor, slot, pos, n in self.runs(blocks, end):
            lo, hi = max(pos, start), min(pos + n, end)
            if lo < hi:
                tensor[:, :, :, slot + lo - pos:slot + hi - pos] = kv[:, :, :, lo - start:hi - start]

    def stats(self) -> dict:
        used = self.used_blocks()
        return {"pool_blocks": self.total_blocks, "pool_blocks_used": used, "pool_block_tokens": self.block_tokens,
                "pool_bytes": self.total_blocks * self.block_bytes, "pool_ram_blocks": self.ram_blocks,
                "pool_spill_blocks": self.spill_blocks, "pool_peak_blocks_used": self.peak_used}


def _consecutive_first(free: np.ndarray, count: int, ram_blocks: int) -> np.ndarray:
    """RAM first: one run of `count` consecutive free blocks there, else any `count` there (a block in
    the spill file sends every step of its sequence to the PyTorch loop); where RAM has fewer, one
    run in the spill file, else the lowest ids."""
    breaks = np.flatnonzero(np.diff(free) != 1) + 1
    runs = list(zip(np.concatenate(([0], breaks)), np.concatenate((breaks, [len(free)]))))
    for s, e in runs:
        if e - s >= count and free[s] + count <= ram_blocks:
            return free[s:s + count]
    if int((free < ram_blocks).sum()) >= count:
        return free[:count]                     # (sorted: RAM's ids come first)
    for s, e in runs:
        if e - s >= count and free[s] >= ram_blocks:
            return free[s:s + count]
    return free[:count]


def _spill_tensor(directory: str, blocks: int, g: KVGeometry, block_tokens: int) -> tuple[torch.Tensor, int]:
    """The spill storage, mapped from a sparse file that is already unlinked, and the file's descriptor
    (kept open to reserve its disk space later: `BlockPool._reserve_spill`)."""
    os.makedirs(directory, exist_ok=True)
    handle, path = tempfile.mkstemp(prefix="spill-", suffix=".kv", dir=directory)
    try:
        shape = (2, g.num_layers, g.kv_heads, blocks * block_tokens, g.row_width)
        numel = int(np.prod(shape))
        tensor = torch.from_file(path, shared=True, size=numel, dtype=g.dtype).view(shape)
    except BaseException:
        os.close(handle)
        raise
    finally:
        os.unlink(path)              # the mapping and the descriptor keep the file alive until exit
    return tensor, handle
