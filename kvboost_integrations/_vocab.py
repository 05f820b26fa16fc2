"""What constrained decoding needs to know about a tokenizer's vocabulary, computed once."""
from __future__ import annotations

import re
from collections import defaultdict

import torch

_NUMERIC_TOKEN = re.compile(r"[-0-9.]+")
_NUMBER_END = (",", "}", "]", "\n")


class Vocabulary:
    """Decoded text of every token id, indexed for the lookups constrained decoding makes.

    by_text: token text -> ids (tokens whose bytes are not whole characters are left out).
    numeric: ids whose text is made of digits, '-' and '.'.
    number_end: ids that end a number inside JSON (',', '}', ']', newline), plus EOS ids.
    """

    def __init__(self, tokenizer, eos_ids=()):
        ids = list(range(len(tokenizer)))
        texts = tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False,
                                       clean_up_tokenization_spaces=False)
        self.by_text: dict[str, list[int]] = defaultdict(list)
        numeric, number_end = [], set(int(e) for e in eos_ids)
        for token_id, text in zip(ids, texts):
            if not text or "\ufffd" in text:
                continue
            self.by_text[text].append(token_id)
            if _NUMERIC_TOKEN.fullmatch(text):
                numeric.append(token_id)
            elif text.lstrip(" ").startswith(_NUMBER_END):
                number_end.add(token_id)
        self.texts = texts
        self.numeric = torch.tensor(numeric, dtype=torch.long)
        self.number_end = torch.tensor(sorted(number_end), dtype=torch.long)

    @classmethod
    def for_engine(cls, engine) -> "Vocabulary":
        eos = {engine.tokenizer.eos_token_id}
        configured = getattr(getattr(engine.model, "generation_config", None), "eos_token_id", None)
        eos.update(configured if isinstance(configured, (list, tuple)) else [configured])
        return cls(engine.tokenizer, [e for e in eos if e is not None])

    def prefix_tokens(self, text: str, *, allow_space: bool) -> list[tuple[int, str, bool]]:
        """(id, prefix, spaced) for every token that spells a non-empty prefix of `text`.

        With `allow_space`, a token may also be one space followed by such a prefix (the
        space is not part of `consumed`): tokenizers often fold the space after ':' into
        the next token; `spaced` says the token carries that space.
        """
        found = []
        for end in range(1, len(text) + 1):
            piece = text[:end]
            found += [(i, piece, False) for i in self.by_text.get(piece, ())]
            if allow_space:
                found += [(i, piece, True) for i in self.by_text.get(" " + piece, ())]
        return found
