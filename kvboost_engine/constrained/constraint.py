"""A grammar as a per-request logits constraint: llguidance computes the allowed-token bitmask for
each step; we apply it to the fp32 logits in place with buffers allocated once per request."""
from __future__ import annotations

import logging

import torch
from llguidance import LLMatcher

from ..errors import InputError, KVBoostError
from .grammars import Grammar
from .vocab import LazyVocab

log = logging.getLogger(__name__)


class GrammarConstraint:
    """The `LogitsConstraint` of one request under one grammar (not shareable between requests).

    mask(): tokens the grammar forbids next go to -inf; end-of-sequence tokens are allowed only
    where the output is complete. is_finished(): nothing but end-of-sequence could follow.
    """

    def __init__(self, matcher: LLMatcher, vocab_size: int, grammar_words: int):
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._bitmask = torch.zeros(grammar_words, dtype=torch.int32)      # [W] filled by llguidance
        self._device: torch.device | None = None

    def _allocate(self, device: torch.device) -> None:
        words = self._bitmask.numel()
        self._device = device
        self._device_bitmask = self._bitmask if device.type == "cpu" else torch.zeros(words, dtype=torch.int32,
                                                                                      device=device)
        self._shifts = torch.arange(32, dtype=torch.int32, device=device)
        self._bits = torch.empty(words, 32, dtype=torch.int32, device=device)          # [W, 32]
        self._forbidden = torch.empty(min(self._vocab_size, words * 32), dtype=torch.bool, device=device)

    @torch.inference_mode()
    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """Forbidden tokens of `logits` [vocab] (fp32) set to -inf, in place (the engine's logits
        are inference tensors: this runs in inference mode)."""
        if self._device != logits.device:
            self._allocate(logits.device)
        self._matcher.unsafe_compute_mask_ptr(self._bitmask.data_ptr(), self._bitmask.numel() * 4)
        self._check()
        bitmask = self._bitmask
        if self._device_bitmask is not bitmask:
            bitmask = self._device_bitmask.copy_(bitmask, non_blocking=True)
        torch.bitwise_right_shift(bitmask.unsqueeze(1), self._shifts, out=self._bits)
        torch.bitwise_and(self._bits, 1, out=self._bits)
        covered = self._forbidden.numel()
        torch.eq(self._bits.view(-1)[:covered], 0, out=self._forbidden)
        logits[:covered].masked_fill_(self._forbidden, float("-inf"))
        if logits.shape[-1] > covered:
            logits[covered:] = float("-inf")          # beyond the tokenizer: never a valid token
        return logits

    def advance(self, token: int) -> None:
        """Feed the chosen token to the grammar."""
        if not self._matcher.consume_token(int(token)):
            raise KVBoostError(f"the grammar rejected token {token}: {self._matcher.get_error()[:500]}")

    def is_finished(self) -> bool:
        return self._matcher.is_stopped()

    def is_accepting(self) -> bool:
        """Whether the output so far is complete (it may still continue)."""
        return self._matcher.is_accepting()

    def _check(self) -> None:
        if self._matcher.is_error():
            raise KVBoostError(f"the grammar failed while decoding: {self._matcher.get_error()[:500]}")


class GrammarCompiler:
    """Compiles `Grammar` descriptions with an engine's tokenizer (built once, on first use)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids):
        self._vocab = LazyVocab(tokenizer, vocab_size, eos_ids)
        self.vocab_size = int(vocab_size)

    def compile(self, grammar: Grammar) -> GrammarConstraint:
        """A fresh constraint for one request. Raises InputError, before any decoding, when the
        grammar is malformed or uses a feature that cannot be enforced (the message names it)."""
        if not isinstance(grammar, Grammar):
            raise InputError(f"expected a constrained.Grammar (JsonSchema, Regex, ...), got {type(grammar).__name__}")
        vocab = self._vocab.get()
        try:
            text = grammar.grammar(vocab)
        except InputError:
            raise
        except ValueError as err:          # llguidance: the schema or grammar is not valid JSON / text
            raise InputError(f"{grammar.describe()} is malformed: {err}") from None
        matcher = LLMatcher(vocab.tokenizer, text, log_level=0)
        if matcher.is_error():
            raise InputError(f"{grammar.describe()} cannot be enforced: {matcher.get_error()}")
        for warning in matcher.get_grammar_warnings():
            log.warning("%s: %s", grammar.describe(), warning)
        words = (vocab.tokenizer.vocab_size + 31) // 32
        return GrammarConstraint(matcher, min(self.vocab_size, words * 32), words)
