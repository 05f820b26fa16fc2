"""Incremental detokenization with stop strings.

Deltas never split a multi-byte character (text ending in U+FFFD is held back), and text that
could be the start of a stop string is held back until it is known not to be one. The stop
string itself is never returned.
"""
from __future__ import annotations


class TextAssembler:
    def __init__(self, tokenizer, stops: tuple[str, ...], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stops = stops
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""              # decoded so far (may include a stop string)
        self.emitted = 0            # characters of self.text already returned as deltas
        self._prefix_offset = 0
        self._read_offset = 0
        self.stopped_at: int | None = None
        self._ends: list[int] = []  # len(self.text) after each token

    def add(self, token_id: int) -> str:
        """Add a generated token; return the text that is now safe to show."""
        self.token_ids.append(token_id)
        self._decode_new()
        self._ends.append(len(self.text))
        if self.stops:
            self._find_stop()
        return self._release()

    def finish(self) -> str:
        """No more tokens: release whatever was held back (short of a stop string)."""
        end = len(self.text) if self.stopped_at is None else self.stopped_at
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta

    @property
    def final_text(self) -> str:
        return self.text if self.stopped_at is None else self.text[:self.stopped_at]

    def ids_for(self, text: str) -> list[int] | None:
        """The shortest run of the first tokens that decodes to `text` (a prefix of the text so far),
        or None; a few decodes whatever the length (the reply memo after a stop string)."""
        for count, end in enumerate(self._ends, start=1):
            if end > len(text):
                return None
            if end == len(text) and self.decode(self.token_ids[:count]) == text:
                return self.token_ids[:count]
        return None

    def decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def _decode_new(self) -> None:
        # Decode a small window ending at the new token; the window's earlier tokens give
        # context so tokenizers that strip leading spaces decode the new piece correctly.
        ids = self.token_ids
        prefix = self.decode(ids[self._prefix_offset:self._read_offset])
        window = self.decode(ids[self._prefix_offset:])
        if len(window) > len(prefix) and not window.endswith("\ufffd"):
            self.text += window[len(prefix):]
            self._prefix_offset = self._read_offset
            self._read_offset = len(ids)

    def _find_stop(self) -> None:
        longest = max(len(s) for s in self.stops)
        search_from = max(0, self.emitted - longest)
        hits = [i for i in (self.text.find(s, search_from) for s in self.stops) if i >= 0]
        if hits:
            self.stopped_at = min(hits)

    def _release(self) -> str:
        if self.stopped_at is not None:
            return self.finish()
        end = len(self.text) - self._held_back()
        if end <= self.emitted:
            return ""
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta

    def _held_back(self) -> int:
        """Length of the longest tail of the text that begins some stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.text)), best, -1):
                if self.text.endswith(stop[:n]):
                    best = n
                    break
        return best
