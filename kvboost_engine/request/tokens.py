"""Segments -> token ids (each segment on its own) and chunk boundaries."""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from .chunking import content_cuts
from .prompt import Segment

ENCODED_TOKENS = 2**18          # token ids of recent segment texts kept (with their cuts) for re-use


@dataclass(slots=True)
class TokenizedPrompt:
    """Token ids of a whole prompt with the chunk boundaries the cache stores it by."""

    token_ids: list[int]
    chunk_ends: list[int]                      # exclusive end of each chunk, ascending, last == len
    chunk_kinds: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)


class PromptTokenizer:
    """Tokenizes segments independently and cuts them into content-defined chunks.

    Segment edges are always chunk edges; inside a segment, cuts are content-defined
    (see chunking.py), at most `chunk_tokens` apart.

    With `memo_entries` (opt-in: EngineConfig.reply_memo_entries) it also remembers the exact ids the
    model generated for recent replies: when a reply comes back as an assistant message in the next
    turn, those ids are used instead of re-tokenizing its text (which may tokenize differently), so
    the reply's cached KV matches token for token, and the prompt depends on this engine's history.
    """

    def __init__(self, tokenizer, chunk_tokens: int, memo_entries: int = 0):
        self.tokenizer = tokenizer
        self.chunk_tokens = chunk_tokens
        self.memo_entries = memo_entries
        self._memo: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._encoded: OrderedDict[str, tuple[tuple[int, ...], tuple[int, ...]]] = OrderedDict()
        self._encoded_tokens = 0
        self._lock = threading.Lock()
        self.special_prefix = list(tokenizer("", add_special_tokens=True)["input_ids"])

    def encode(self, segments: list[Segment], *, add_special_prefix: bool) -> TokenizedPrompt:
        ids: list[int] = []
        ends: list[int] = []
        kinds: list[str] = []
        if add_special_prefix and self.special_prefix:
            ids.extend(self.special_prefix)
            ends.append(len(ids))
            kinds.append("glue")
        for seg in segments:
            seg_ids, cuts = self._segment(seg)
            base = len(ids)
            ids.extend(seg_ids)
            for cut in cuts:
                ends.append(base + cut)
                kinds.append(seg.kind)
        return TokenizedPrompt(ids, ends, kinds)

    def cuts(self, token_ids: list[int]) -> list[int]:
        """Content-defined chunk ends inside one segment (average chunk_tokens / 8 tokens)."""
        average = max(8, self.chunk_tokens // 8)
        return content_cuts(token_ids, min_tokens=average // 2, avg_tokens=average, max_tokens=self.chunk_tokens)

    def _segment(self, seg: Segment) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(token ids, chunk cuts) of one segment; recent texts come from a bounded memo (a chat
        re-sends the same system prompt and history on every turn)."""
        if not seg.text:
            return (), ()
        with self._lock:
            if seg.kind == "assistant":
                remembered = self._memo.get(seg.text)
                if remembered is not None:
                    self._memo.move_to_end(seg.text)
                    return remembered, tuple(self.cuts(list(remembered)))
            known = self._encoded.get(seg.text)
            if known is not None:
                self._encoded.move_to_end(seg.text)
                return known
        seg_ids = tuple(self.tokenizer(seg.text, add_special_tokens=False)["input_ids"])
        known = (seg_ids, tuple(self.cuts(list(seg_ids))))
        if len(seg_ids) <= ENCODED_TOKENS // 4:
            with self._lock:
                if seg.text not in self._encoded:
                    self._encoded[seg.text] = known
                    self._encoded_tokens += len(seg_ids)
                while self._encoded_tokens > ENCODED_TOKENS:
                    self._encoded_tokens -= len(self._encoded.popitem(last=False)[1][0])
        return known

    def remember_reply(self, text: str, token_ids: list[int]) -> None:
        """Record that `token_ids` (decoding to exactly `text`) is what the model generated."""
        if not text or self.memo_entries == 0:
            return
        with self._lock:
            self._memo[text] = tuple(token_ids)
            self._memo.move_to_end(text)
            while len(self._memo) > self.memo_entries:
                self._memo.popitem(last=False)
