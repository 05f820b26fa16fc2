"""The engine's tokenizer as llguidance sees it: built once per engine (it takes a second or more),
shared by every constrained request of that engine."""
from __future__ import annotations

import copy
import json
import re
import threading

from llguidance import LLTokenizer

from ..errors import InputError


class GrammarVocab:
    """An llguidance tokenizer for a HF fast tokenizer, sized to the model's logits.

    `vocab_size` is the length of the model's logits (it may exceed the tokenizer's vocabulary:
    padded embeddings; tokens beyond the tokenizer are never allowed). Only `eos_ids` end a
    constrained output, and only where the grammar is complete.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_ids):
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise InputError("constrained decoding needs a fast (tokenizers-backed) tokenizer; "
                             f"this model has {type(tokenizer).__name__}")
        backend = copy.copy(backend)           # no padding or truncation in the serialized copy
        backend.no_padding()
        backend.no_truncation()
        self.vocab_size = int(vocab_size)
        size = max(self.vocab_size, len(tokenizer))
        eos = sorted(int(e) for e in eos_ids if 0 <= int(e) < size)
        if not eos:
            raise InputError("constrained decoding needs an end-of-sequence token; the tokenizer has none")
        self.tokenizer = LLTokenizer(backend.to_str(), n_vocab=size, eos_token=eos)
        added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
        self.special = {text: int(i) for text, i in added.items()
                        if text and 0 <= int(i) < size and self.tokenizer.is_special_token(int(i))}
        ordered = sorted(self.special, key=len, reverse=True)
        self._special_re = re.compile("(" + "|".join(map(re.escape, ordered)) + ")") if ordered else None

    def literal(self, text: str) -> str:
        """A Lark expression matching exactly `text`. Special (added) tokens inside it, such as
        `[TOOL_CALLS]` or `<tool_call>`, become that one token, as the chat template tokenizes them."""
        if not isinstance(text, str) or not text:
            raise InputError(f"a literal must be a non-empty string, got {text!r}")
        pieces = self._special_re.split(text) if self._special_re is not None else [text]
        out = [f"<[{self.special[p]}]>" if p in self.special else json.dumps(p) for p in pieces if p]
        return " ".join(out)


class LazyVocab:
    """Builds the GrammarVocab on first use (thread-safe), so engines that never constrain pay nothing."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids):
        self._args = (tokenizer, vocab_size, frozenset(eos_ids))
        self._vocab: GrammarVocab | None = None
        self._lock = threading.Lock()

    def get(self) -> GrammarVocab:
        with self._lock:
            if self._vocab is None:
                self._vocab = GrammarVocab(*self._args)
            return self._vocab
