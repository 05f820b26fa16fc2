"""Engine options: one slotted dataclass, validated once."""
from __future__ import annotations

from dataclasses import dataclass

from .errors import InputError

DEFAULT_CACHE_BYTES = 2 * 1024**3
DEFAULT_CHUNK_TOKENS = 256


@dataclass(slots=True, frozen=True)
class EngineConfig:
    """Options fixed for the life of an engine.

    cache_bytes: byte budget of the reusable KV cache; 0 turns reuse off (same code path,
        nothing stored), which is the baseline for every comparison.
    chunk_tokens: longest chunk stored as one cache node; segments longer than this are cut.
    reply_memo_entries: how many recent replies remember the exact token ids the model
        generated, so the next turn's prompt re-uses those ids instead of re-tokenizing.
    """

    cache_bytes: int = DEFAULT_CACHE_BYTES
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    reply_memo_entries: int = 512

    def __post_init__(self) -> None:
        if not isinstance(self.cache_bytes, int) or self.cache_bytes < 0:
            raise InputError(f"cache_bytes must be an int >= 0, got {self.cache_bytes!r}")
        if not isinstance(self.chunk_tokens, int) or self.chunk_tokens < 1:
            raise InputError(f"chunk_tokens must be an int >= 1, got {self.chunk_tokens!r}")
        if self.reply_memo_entries < 0:
            raise InputError("reply_memo_entries must be >= 0")
