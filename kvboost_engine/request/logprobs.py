"""Log-probabilities of generated tokens, in OpenAI's chat format, and text deltas that carry them."""
from __future__ import annotations

import re
from functools import lru_cache

import torch

FLOOR = -9999.0         # what OpenAI reports for a token that cannot be chosen (-inf is not JSON)


class TextDelta(str):
    """A text delta of a stream that records logprobs: the text, plus `logprobs`, the entries of
    the tokens generated since the previous delta (OpenAI's `logprobs.content` items)."""

    __slots__ = ("logprobs",)

    def __new__(cls, text: str, logprobs: list[dict]):
        delta = super().__new__(cls, text)
        delta.logprobs = logprobs
        return delta


class LogprobRecorder:
    """Turns (processed logits, chosen token) into an entry: token text, id, logprob, UTF-8
    bytes and the `top` best alternatives (each with the same fields)."""

    def __init__(self, tokenizer, top: int):
        self.tokenizer = tokenizer
        self.top = top
        self._texts: dict[int, str] = {}

    def entry(self, logits: torch.Tensor, token: int) -> dict:
        logprobs = torch.log_softmax(logits.float(), dim=-1)      # [vocab]
        item = self._item(token, float(logprobs[token]))
        item["top_logprobs"] = []
        if self.top:
            values, ids = torch.topk(logprobs, min(self.top, logprobs.shape[-1]))
            item["top_logprobs"] = [self._item(int(i), float(v)) for v, i in zip(values.tolist(), ids.tolist())]
        return item

    def _item(self, token: int, logprob: float) -> dict:
        text, raw = self._text(token)
        return {"token": text, "token_id": token, "logprob": max(logprob, FLOOR), "bytes": list(raw)}

    def _text(self, token: int) -> tuple[str, bytes]:
        known = self._texts.get(token)
        if known is None:
            text = self.tokenizer.decode([token], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            known = self._texts[token] = (text, self._bytes(token, text))
        return known

    def _bytes(self, token: int, text: str) -> bytes:
        """The token's own bytes: its text's, unless it is part of a character (decoded as U+FFFD):
        then a byte-fallback piece (<0xE2>) or a byte-level BPE piece read back to its bytes."""
        if "\ufffd" not in text:
            return text.encode()
        piece = self.tokenizer.convert_ids_to_tokens(token)
        if isinstance(piece, str):
            fallback = _BYTE_PIECE.fullmatch(piece)
            if fallback:
                return bytes([int(fallback.group(1), 16)])
            table = _byte_level_decoder()
            if all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece)
        return text.encode()


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte (a constant table)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars
