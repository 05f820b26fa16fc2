"""Constrained decoding: a per-request object that masks the logits before every sampled token.

The decode loop (request/decode.py) calls, for each generated token:
    logits = constraint.mask(logits)      # forbidden tokens at -inf (in place allowed); [vocab] fp32
    token = sample(logits)
    constraint.advance(token)
and stops with finish_reason "stop" once `constraint.is_finished()` (nothing more may follow), or
when the model picks an end-of-sequence token (allowed only where the output is complete).
One prefill with the usual reuse, then one mask per step: token ids, usage and telemetry are the
real ones.

Grammars (`JsonSchema`, `AnyJson`, `Regex`, `Choice`, `Lark`, `TaggedJson`) are compiled by the
engine with llguidance against its own tokenizer (built once per engine) into a
`GrammarConstraint`; any other object with the three methods below works too.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from .constraint import GrammarCompiler, GrammarConstraint
from .grammars import AnyJson, Choice, Grammar, JsonSchema, Lark, Regex, TaggedJson
from .schema import prepare_schema


@runtime_checkable
class LogitsConstraint(Protocol):
    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [vocab] (fp32) with every token the constraint forbids set to -inf."""

    def advance(self, token: int) -> None:
        """The token that was chosen (always one `mask` allowed)."""

    def is_finished(self) -> bool:
        """True once the output is complete and no further token is allowed."""


__all__ = ["LogitsConstraint", "Grammar", "JsonSchema", "AnyJson", "Regex", "Choice", "Lark", "TaggedJson",
           "GrammarCompiler", "GrammarConstraint", "prepare_schema"]
