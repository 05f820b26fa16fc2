"""The chunk cache's disk side: write-through of new chunks, and reading chunks back on a miss.

New nodes are written to the disk tier in the background (their blocks are held IN_USE until
their KV has been copied out). A lookup that ends on a node boundary reads the prompt's next
chunks from disk by prefix key, in order, for as long as they continue the prompt; the cache
then adopts them into the tree. Entries are checksummed by the disk tier; a bad file is a miss.
File I/O runs without the cache lock.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .codec import FloatCodec
from .keys import PrefixHasher
from .pool import BlockPool
from .tree import Node


@dataclass(slots=True)
class PendingWrite:
    key: bytes
    start: int
    tokens: tuple
    exact: bool
    table: list                 # block table holding one IN_USE reference per block until written


@dataclass(slots=True)
class DiskEntry:
    start: int
    end: int
    kv: torch.Tensor            # [2, layers, kv_heads, end - start, head_dim]
    exact: bool


class DiskRestore:
    def __init__(self, disk, pool: BlockPool, fingerprint: bytes, codec=None):
        self.disk = disk
        self.pool = pool
        self.fingerprint = fingerprint
        self.codec = codec or FloatCodec()

    def pending(self, nodes: list[Node]) -> list[PendingWrite]:
        """New nodes not yet on disk, their blocks held until written (call with the cache lock).
        None for a read-only disk tier (it is only read). An exact node replaces an approximate
        entry of its key (another engine's repaired chunk, which this engine cut off at a match)."""
        if self.disk.read_only:
            return []
        pending = []
        for node in nodes:
            if not self.disk.contains(node.key, exact=node.exact):
                self.pool.retain(node.blocks)
                table = [None] * node.first_block + node.blocks
                pending.append(PendingWrite(node.key, node.start, node.tokens, node.exact, table))
        return pending

    def write(self, pending: list[PendingWrite]) -> None:
        """Queue the KV of pending nodes for the disk (without the cache lock)."""
        for index, item in enumerate(pending):
            try:
                kv = self.codec.encode(self.pool.read(item.table, item.start, len(item.tokens)))
                self.disk.put_async(item.key, item.start, item.tokens, kv, item.exact)
            except BaseException:
                for rest in pending[index + 1:]:        # not written either: their references go too
                    self.pool.release([b for b in rest.table if b is not None])
                raise
            finally:
                self.pool.release([b for b in item.table if b is not None])

    def read(self, tokens, limit: int, chunk_ends, offset: int) -> list[DiskEntry]:
        """Disk entries that continue tokens[:offset], chunk by chunk, in order (without the lock)."""
        hasher = PrefixHasher(self.fingerprint)
        hasher.update(tokens[:offset])
        cursor, entries = offset, []
        for end in (c for c in chunk_ends if offset < c <= limit):
            hasher.update(tokens[cursor:end])
            cursor = end
            entry = self.disk.get(hasher.key())
            if entry is None:
                break
            start, entry_tokens, data, exact = entry
            if start > offset or tuple(tokens[start:end]) != tuple(entry_tokens):
                break
            kv = self.codec.decode(data, len(entry_tokens))
            entries.append(DiskEntry(start, end, kv, exact and self.codec.exact))
            offset = end
        return entries
