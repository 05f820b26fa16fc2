"""The disk tier of the KV cache: entries that survive restarts, checksummed, written atomically.

    DiskTier(directory, budget_bytes, fingerprint)   see tier.py
    fileformat.py   one entry per file: header, token ids, raw KV bytes, xxh3-128 checksum
    index.py        sizes and recency under the byte budget
    writer.py       the write-behind thread of put_async
"""
from .fileformat import FORMAT_VERSION, CorruptEntry
from .tier import DiskTier

__all__ = ["DiskTier", "FORMAT_VERSION", "CorruptEntry"]
