"""What a constrained request may output, described independently of any tokenizer.

Pass one of these as `constraint=` to `Engine.chat`/`stream_chat`/`generate`/`stream`; the engine
compiles it with its own tokenizer (llguidance) before any decoding, so a schema feature that
cannot be enforced is an InputError naming it, not a silently wrong output.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from llguidance import LLMatcher

from ..errors import InputError
from .schema import JSON_STYLE, prepare_schema
from .vocab import GrammarVocab


class Grammar:
    """Base class of output descriptions: `grammar(vocab)` gives llguidance's grammar text."""

    def grammar(self, vocab: GrammarVocab) -> str:  # pragma: no cover - every subclass overrides
        raise NotImplementedError

    def describe(self) -> str:
        return type(self).__name__


@dataclass(frozen=True)
class JsonSchema(Grammar):
    """One JSON value valid under `schema` (a dict). Objects that do not say otherwise are closed
    (no keys beyond `properties`); JSON is written compactly, as `json.dumps` writes it."""

    schema: dict

    def grammar(self, vocab: GrammarVocab) -> str:
        return LLMatcher.grammar_from_json_schema(prepare_schema(self.schema))

    def describe(self) -> str:
        return "JSON schema"


@dataclass(frozen=True)
class AnyJson(Grammar):
    """Any JSON value (json_mode); with `object_only` (default) a JSON object."""

    object_only: bool = True

    def grammar(self, vocab: GrammarVocab) -> str:
        schema = {"type": "object"} if self.object_only else {}
        return LLMatcher.grammar_from_json_schema({**schema, "x-guidance": JSON_STYLE})


@dataclass(frozen=True)
class Regex(Grammar):
    """Text matching `pattern` in full (Rust `regex` syntax: no look-around, no back-references)."""

    pattern: str

    def grammar(self, vocab: GrammarVocab) -> str:
        if not isinstance(self.pattern, str) or not self.pattern:
            raise InputError(f"Regex needs a non-empty pattern string, got {self.pattern!r}")
        return LLMatcher.grammar_from_regex(self.pattern)


@dataclass(frozen=True)
class Choice(Grammar):
    """Exactly one of `options` (strings)."""

    options: tuple[str, ...]

    def grammar(self, vocab: GrammarVocab) -> str:
        options = [self.options] if isinstance(self.options, str) else list(self.options)
        if not options or not all(isinstance(o, str) and o for o in options):
            raise InputError(f"Choice needs a list of non-empty strings, got {self.options!r}")
        return LLMatcher.grammar_from_lark("start: " + " | ".join(f"({vocab.literal(o)})" for o in options))


@dataclass(frozen=True)
class Lark(Grammar):
    """A Lark grammar (llguidance's dialect: `start` rule, `%json {schema}` inline, special tokens
    as `<|name|>` or `<[id]>`)."""

    grammar_text: str

    def grammar(self, vocab: GrammarVocab) -> str:
        if not isinstance(self.grammar_text, str) or "start" not in self.grammar_text:
            raise InputError("Lark needs grammar text with a `start` rule")
        return LLMatcher.grammar_from_lark(self.grammar_text)


@dataclass(frozen=True)
class TaggedJson(Grammar):
    """`prefix`, one JSON value valid under `schema`, `suffix`: the shape of a tool call such as
    `<tool_call>\\n{...}\\n</tool_call>` or `[TOOL_CALLS] [{...}]`. Special tokens in the prefix or
    suffix are the tokenizer's single tokens. Empty prefix/suffix: nothing there."""

    prefix: str
    schema: dict
    suffix: str = ""

    def grammar(self, vocab: GrammarVocab) -> str:
        parts = [vocab.literal(self.prefix) if self.prefix else "", "body",
                 vocab.literal(self.suffix) if self.suffix else ""]
        body = json.dumps(prepare_schema(self.schema), ensure_ascii=False)
        return LLMatcher.grammar_from_lark(f"start: {' '.join(p for p in parts if p)}\nbody: %json {body}\n")

    def describe(self) -> str:
        return "JSON schema (tagged)"
