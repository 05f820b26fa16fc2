"""Cache keys: prefix keys (xxh3-128 over token ids, seeded with the model fingerprint)."""
from __future__ import annotations

from array import array

import xxhash


def token_bytes(token_ids) -> bytes:
    return array("i", token_ids).tobytes()


class PrefixHasher:
    """Running hash of a token prefix: `key()` after any number of tokens is boundary-independent,
    so a prefix has the same key however it was cut into chunks."""

    __slots__ = ("_h",)

    def __init__(self, fingerprint: bytes):
        self._h = xxhash.xxh3_128()
        self._h.update(fingerprint)

    def update(self, token_ids) -> None:
        self._h.update(token_bytes(token_ids))

    def key(self) -> bytes:
        return self._h.digest()
