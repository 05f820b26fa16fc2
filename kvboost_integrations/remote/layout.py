"""Prompt layout for a server's prefix cache: what goes first, in which order, joined how.

A serving engine (vLLM, llama.cpp's server) reuses the KV of the longest prefix it has seen
before, token for token. So the layout:

- keeps stable text first: system prompts and history as they are. The text itself is sent as
  given by default (`volatile="keep"`); the opt-in `volatile="last"` moves volatile sentences
  (timestamps, dates, UUIDs, long hex ids) out of system messages into the last user message,
  before its question, where they no longer spoil the prefix of everything after them (the
  model then reads another prompt than the one written: the reply's `volatile_moved` lists them);
- orders documents cache-first (`document_order="cache"`): the documents of a request that
  follow a sequence already sent after the same text are put in that sequence's order, the rest
  after them in the order given (relevance); `"relevance"` keeps the given order everywhere;
- joins a message's parts with "\\n\\n", or with LMCache CacheBlend's separator
  (`blend_separator`, its `blend_special_str`) around documents; for our own server, which caches
  documents itself, keeps them as `{"type": "document"}` parts instead (`WirePrompt.part_messages`);
- names the leading segments (system messages and the first message up to its first document)
  whose hash routes the request to the replica most likely to hold its prefix.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import xxhash

from kvboost_engine import InputError

from .sequences import DocumentSequences

DOCUMENT_ORDERS = ("cache", "relevance")
VOLATILE_MODES = ("last", "keep")
VOLATILE_PATTERNS = (
    r"\b\d{4}-\d{2}-\d{2}(?:[T ]\d{1,2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?)?\b",  # ISO date/time
    r"\b\d{1,2}:\d{2}:\d{2}\b",                                                                # clock time
    r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b",          # UUID
    r"\b[0-9a-fA-F]{16,}\b",                                                                   # long hex id
    r"\b1[5-9]\d{8}(?:\.\d+)?\b",                                                              # unix time
)
PART_JOINER = "\n\n"
_VOLATILE = "volatile"      # the part kind of moved volatile text (sent as text, never part of a route key)
_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")


@dataclass(frozen=True)
class LayoutOptions:
    """How prompts are laid out; see the module docstring."""

    document_order: str = "cache"
    volatile: str = "keep"
    volatile_patterns: tuple[str, ...] = VOLATILE_PATTERNS
    blend_separator: str | None = None
    remembered_sequences: int = 4096

    def __post_init__(self):
        if self.document_order not in DOCUMENT_ORDERS:
            raise InputError(f"document_order must be one of {DOCUMENT_ORDERS}, got {self.document_order!r}")
        if self.volatile not in VOLATILE_MODES:
            raise InputError(f"volatile must be one of {VOLATILE_MODES}, got {self.volatile!r}")
        if self.blend_separator == "":
            raise InputError("blend_separator must be a non-empty string (LMCache's blend_special_str) or None")
        if self.remembered_sequences < 1:
            raise InputError(f"remembered_sequences must be at least 1, got {self.remembered_sequences}")
        for pattern in self.volatile_patterns:
            re.compile(pattern)


@dataclass
class WirePrompt:
    """A laid-out chat prompt: OpenAI wire messages, the route key, and its segments in order.

    segments: (kind, text) with kind "system", "message" or "document", in the order sent
    (for telemetry: how many document tokens there are and where they start). placed: documents
    put first because they continue a sequence sent before. part_messages: the same messages with
    their content parts kept (text and document parts, in the same order), for a server that takes
    document parts (ours).
    """

    messages: list[dict]
    part_messages: list[dict]
    route_key: int
    segments: list[tuple[str, str]] = field(default_factory=list)
    moved_volatile: list[str] = field(default_factory=list)
    placed: int = 0


def route_key_of_text(prompt: str, chars: int = 1024) -> int:
    """Route key of a plain prompt: its first `chars` characters (no structure to go by)."""
    return xxhash.xxh64_intdigest(prompt[:chars].encode())


class PromptLayout:
    """Lays out engine messages for the wire; remembers document sequences sent (thread-safe)."""

    def __init__(self, options: LayoutOptions | None = None):
        self.options = options or LayoutOptions()
        self._sequences = DocumentSequences(self.options.remembered_sequences)
        self._volatile = re.compile("|".join(f"(?:{p})" for p in self.options.volatile_patterns)) \
            if self.options.volatile_patterns else None

    def lay_out(self, messages: list[dict], *, record: bool = True) -> WirePrompt:
        """The wire prompt for engine-style `messages` (content: a str or text/document parts)."""
        if not messages:
            raise InputError("a chat request needs at least one message")
        messages, moved = self._move_volatile([_checked(m) for m in messages])
        wire, with_parts, segments, route = [], [], [], xxhash.xxh64()
        context = xxhash.xxh64()
        routing, placed = True, 0
        for message in messages:
            parts, count = self._ordered_parts(message, context, record)
            placed += count
            wire.append(_wire_message(message, parts, self.options.blend_separator))
            with_parts.append(_part_message(message, parts, wire[-1]))
            kind_of_text = "system" if message["role"] == "system" else "message"
            for kind, text in parts:
                segments.append(("document" if kind == "document" else kind_of_text, text))
            routing = _feed_route(route, message["role"], parts, routing)
            context.update(json.dumps(wire[-1], sort_keys=True).encode())
        return WirePrompt(wire, with_parts, route.intdigest(), segments, moved, placed)

    def _ordered_parts(self, message: dict, context, record: bool) -> tuple[list[tuple[str, str]], int]:
        """(kind, text) parts of a message, document runs reordered cache-first; documents placed."""
        parts = _parts(message["content"])
        if self.options.document_order == "relevance":
            return parts, 0
        out: list[tuple[str, str]] = []
        index = placed = 0
        while index < len(parts):
            if parts[index][0] != "document":
                out.append(parts[index])
                index += 1
                continue
            end = index
            while end < len(parts) and parts[end][0] == "document":
                end += 1
            prefix = context.copy()
            prefix.update(json.dumps([message["role"], out]).encode())
            texts, count = self._sequences.order(prefix.intdigest(), [text for _, text in parts[index:end]], record)
            out.extend(("document", text) for text in texts)
            placed += count
            index = end
        return out, placed

    def _move_volatile(self, messages: list[dict]) -> tuple[list[dict], list[str]]:
        """With volatile="last": the system messages before the last user message without their
        volatile sentences; those go into that user message, before its question (never into an
        assistant or tool message). With "keep", or no user message, the messages as given."""
        target = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
        if self.options.volatile == "keep" or self._volatile is None or target is None:
            return messages, []
        moved: list[str] = []
        out = []
        for position, message in enumerate(messages):
            if position == target:
                sent_at = len(out)          # its index once emptied system messages are dropped
            if message["role"] != "system" or position > target:
                out.append(message)
                continue
            content, lines = _strip_lines(message["content"], self._volatile)
            moved += lines
            if _parts(content) or not lines:
                out.append({**message, "content": content})
        if moved:
            out[sent_at] = {**out[sent_at], "content": _prepend_text(out[sent_at]["content"], "\n".join(moved))}
        return out, moved


def _checked(message: dict) -> dict:
    if not isinstance(message, dict) or "role" not in message or "content" not in message:
        raise InputError(f"a message must be a dict with 'role' and 'content', got {message!r}")
    return message


def _parts(content) -> list[tuple[str, str]]:
    if content is None:
        return []
    if isinstance(content, str):
        return [("text", content)] if content else []
    parts = []
    for part in content:
        kind = part.get("type")
        if kind not in ("text", "document", _VOLATILE):
            raise InputError(f"the remote backend sends text only; got a content part of type {kind!r}")
        parts.append((kind, part.get("text") or ""))
    return parts


def _wire_message(message: dict, parts: list[tuple[str, str]], blend_separator: str | None) -> dict:
    out: dict = {"role": message["role"], "content": _join(parts, blend_separator)}
    if message.get("tool_calls"):
        out["tool_calls"] = [_wire_call(call) for call in message["tool_calls"]]
        out["content"] = out["content"] or None
    for key in ("tool_call_id", "name"):
        if message.get(key):
            out[key] = message[key]
    return out


def _part_message(message: dict, parts: list[tuple[str, str]], wire: dict) -> dict:
    """`wire` as our own server reads it: the content as parts when the message came as parts (string
    content stays a string; moved volatile text is a text part), and an assistant turn's thinking
    (`reasoning_content`) for its template, which keeps or drops it as a local engine's does."""
    out = dict(wire)
    if isinstance(message["content"], list):
        content = [{"type": "document" if kind == "document" else "text", "text": text} for kind, text in parts]
        out["content"] = content or wire["content"]
    if message.get("role") == "assistant" and isinstance(message.get("reasoning_content"), str):
        out["reasoning_content"] = message["reasoning_content"]
    return out


def _join(parts: list[tuple[str, str]], blend_separator: str | None) -> str:
    """Parts joined by a blank line; with CacheBlend's separator around documents instead."""
    if blend_separator is None or not any(kind == "document" for kind, _ in parts):
        return PART_JOINER.join(text for _, text in parts)
    text = blend_separator if parts[0][0] == "document" else ""
    return text + blend_separator.join(text for _, text in parts)


def _wire_call(call: dict) -> dict:
    function = call.get("function", call)
    arguments = function.get("arguments", function.get("args", {}))
    return {"id": call.get("id"), "type": "function",
            "function": {"name": function["name"],
                         "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}}


def _feed_route(route, role: str, parts: list[tuple[str, str]], routing: bool) -> bool:
    """Hash the leading segments: system messages, then the first other message up to its first
    document (or its first part). Returns whether later messages still count."""
    if not routing:
        return False
    route.update(role.encode() + b"\x00")
    if role == "system":
        for _, text in parts:
            route.update(text.encode() + b"\x00")
        return True
    for kind, text in parts:
        if kind == _VOLATILE:
            continue
        route.update(text.encode() + b"\x00")
        if kind == "document" or not any(k == "document" for k, _ in parts):
            break
    return False


def _strip_lines(content, pattern: re.Pattern) -> tuple[str | list[dict], list[str]]:
    if isinstance(content, str):
        kept, moved = _split_lines(content, pattern)
        return kept, moved
    out, moved = [], []
    for part in content:
        if part.get("type") == "text":
            kept, lines = _split_lines(part.get("text") or "", pattern)
            moved += lines
            part = {**part, "text": kept}
        out.append(part)
    return out, moved


def _split_lines(text: str, pattern: re.Pattern) -> tuple[str, list[str]]:
    """`text` without its volatile sentences (a line's sentences that match), and those sentences."""
    kept_lines, moved = [], []
    for line in text.split("\n"):
        if not pattern.search(line):
            kept_lines.append(line)
            continue
        sentences = _SENTENCE.split(line)
        moved += [s for s in sentences if pattern.search(s)]
        rest = " ".join(s for s in sentences if not pattern.search(s))
        if rest.strip():
            kept_lines.append(rest)
    return ("\n".join(kept_lines), moved) if moved else (text, [])


def _prepend_text(content, text: str) -> list[dict]:
    """`text` as a volatile part before the last text part of a message (a question comes after it)."""
    if content is None or isinstance(content, str):
        content = [{"type": "text", "text": content}] if content else []
    parts = list(content)
    last_text = max((i for i, p in enumerate(parts) if p.get("type") == "text"), default=len(parts))
    return parts[:last_text] + [{"type": _VOLATILE, "text": text}] + parts[last_text:]
