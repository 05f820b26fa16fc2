"""Prompt -> ordered segments.

Chat messages are rendered through the model's own chat template with a placeholder in place
of every content part; the rendered string is then split at the placeholders, so template glue,
the system prompt, every message and every part are separate segments. Each segment is later
tokenized on its own: the same text gives the same tokens wherever it appears.
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..errors import InputError

ROLES = ("system", "user", "assistant", "tool")
PART_TYPES = ("text", "document")
PART_SEPARATOR = "\n\n"
# Private-use code points: no template or tokenizer gives them meaning.
_PLACEHOLDER = "\ue000{}\ue001"
_PLACEHOLDER_RE = re.compile("\ue000(\\d+)\ue001")
_PROBE = "kvboost: the next user turn"          # warm(): where a user turn's text would begin


@dataclass(slots=True, frozen=True)
class Segment:
    """A piece of prompt text with its role in the prompt.

    kind: "glue" (template text), "system", "user", "assistant", "tool", "document",
        "text" (a plain prompt). Content of every kind but glue is indexed for moved reuse.
    """

    text: str
    kind: str = "text"

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise InputError(f"segment text must be a string, got {type(self.text).__name__}")


def template_options(value) -> dict:
    """Keyword arguments for the chat template (a request's `template_kwargs`): a mapping, or None."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InputError(f"template_kwargs must be a mapping of keyword arguments, got {type(value).__name__}")
    return dict(value)


def segments_from_prompt(prompt) -> list[Segment]:
    """A plain string, or a sequence of `Segment`/str/{"text", "kind"} items, as segments."""
    if isinstance(prompt, str):
        items = [Segment(prompt)]
    elif isinstance(prompt, Sequence):
        items = [_as_segment(item) for item in prompt]
    else:
        raise InputError(f"prompt must be a string or a sequence of segments, got {type(prompt).__name__}")
    for index, seg in enumerate(items):
        check_unicode(seg.text, f"prompt segment {index}")
    if not any(seg.text for seg in items):
        raise InputError("prompt is empty")
    return items


def _as_segment(item) -> Segment:
    if isinstance(item, Segment):
        return item
    if isinstance(item, str):
        return Segment(item)
    if isinstance(item, Mapping) and "text" in item:
        kind = item.get("kind", item.get("type", "text"))
        return Segment(item["text"], kind)
    raise InputError(f"a prompt segment must be a Segment, a string or a dict with 'text', got {item!r:.80}")


def check_unicode(text: str, where: str) -> None:
    """InputError naming `where` if `text` cannot be encoded (a lone surrogate such as "\\ud800"):
    such text is refused, not repaired, so a prompt is never silently changed."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InputError(f"{where} is not valid Unicode: lone surrogate {text[error.start]!r} at character "
                         f"{error.start} (fix the text, e.g. text.encode('utf-8', 'replace').decode())") from None


def message_parts(message, index: int = 0) -> list[Segment]:
    """Validate one OpenAI-style message (the `index`-th) and return its content parts as segments."""
    if not isinstance(message, Mapping):
        raise InputError(f"each message must be a dict with 'role' and 'content', got {type(message).__name__}")
    role = message.get("role")
    if role not in ROLES:
        raise InputError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
    content = message.get("content")
    if content is None and role == "assistant" and message.get("tool_calls"):
        content = ""
    if isinstance(content, str):
        parts = [Segment(content, role)]
    elif isinstance(content, Sequence) and not isinstance(content, (bytes, bytearray)):
        parts = [_part_segment(part, role) for part in content]
    else:
        raise InputError(
            f"message content must be a string or a list of parts, got {type(content).__name__} (role {role!r})"
        )
    for seg in parts:
        check_unicode(seg.text, f"message {index} (role {role!r})")
    return parts


def _part_segment(part, role: str) -> Segment:
    if not isinstance(part, Mapping) or part.get("type") not in PART_TYPES:
        raise InputError(f"a content part must be {{'type': 'text'|'document', 'text': str}}, got {part!r:.80}")
    text = part.get("text")
    if not isinstance(text, str):
        raise InputError(f"content part text must be a string, got {type(text).__name__}")
    if part["type"] == "document":
        return Segment(text, "document")
    return Segment(text, role)


# apply_chat_template's own keywords that would change what it returns (tokens, a dict, tensors) or clash
# with the arguments the renderer passes; any other template_kwargs go to the template as variables
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "tokenize", "return_dict", "return_tensors", "padding",
                                      "truncation", "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask"})


class ChatRenderer:
    """Renders messages with a tokenizer's chat template into segments."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def render(self, messages, *, add_generation_prompt: bool = True, **template_kwargs) -> list[Segment]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise InputError("this model's tokenizer has no chat template; use generate() with a plain prompt")
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise InputError("messages must be a list of {'role', 'content'} dicts")
        if not messages:
            raise InputError("messages is empty")
        for name, value in (("add_generation_prompt", add_generation_prompt),
                            ("continue_final_message", template_kwargs.get("continue_final_message", False))):
            if not isinstance(value, bool):         # Jinja would take "false" as true
                raise InputError(f"{name} must be a bool, got {value!r}")
        parts = [message_parts(m, i) for i, m in enumerate(messages)]
        if not any(seg.text for msg in parts for seg in msg):
            raise InputError("all messages are empty")
        flat: list[Segment] = []
        templated = []
        for message, msg_parts in zip(messages, parts):
            marks = []
            for seg in msg_parts:
                marks.append(_PLACEHOLDER.format(len(flat)))
                flat.append(seg)
            templated.append({**message, "content": PART_SEPARATOR.join(marks)})
        rendered = self._apply(templated, add_generation_prompt, template_kwargs)
        check_unicode(rendered, "the rendered chat (message fields other than content, or template_kwargs)")
        segments = _split_rendered(rendered, flat)
        real = [{**m, "content": PART_SEPARATOR.join(s.text for s in p)} for m, p in zip(messages, parts)]
        if segments is None or "".join(s.text for s in segments) != self._apply(real, add_generation_prompt, template_kwargs):
            # The template rewrites content (trim, escaping...): keep it correct as one plain segment.
            return [Segment(self._apply(real, add_generation_prompt, template_kwargs), "text")]
        return segments

    def prefix(self, messages) -> list[Segment]:
        """The segments a chat going on from `messages` with a user turn begins with (what
        `Engine.warm` caches). For a chat that ends with a system message, rendered with a user turn
        after it and cut before that turn's text: templates that fold the system prompt into a user
        turn (Gemma 3: the first; Mistral: the last) render nothing of it without one. Otherwise, or
        where the template refuses that turn, the chat without a generation prompt (which checks it)."""
        plain = self.render(messages, add_generation_prompt=False)
        last = messages[-1]
        if isinstance(last, Mapping) and last.get("role") == "system":
            try:
                segments = self.render([*messages, {"role": "user", "content": _PROBE}], add_generation_prompt=False)
            except InputError:
                segments = []
            at = next((i for i, seg in enumerate(segments) if seg.kind != "glue" and seg.text == _PROBE), 0)
            if at:
                return segments[:at]
        return plain

    def _apply(self, messages, add_generation_prompt: bool, template_kwargs: dict) -> str:
        """The chat as the template renders it. What the caller sent (its messages, its template_kwargs)
        and the template cannot render together is an InputError: a template's own refusal
        (`raise_exception`: roles that must alternate...), a keyword apply_chat_template cannot take."""
        reserved = sorted(set(template_kwargs) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise InputError(f"template_kwargs cannot set {', '.join(reserved)}: the engine renders the chat "
                             "as text itself (add_generation_prompt is its own argument)")
        try:
            from jinja2 import TemplateError
        except ImportError:         # transformers says what is missing when it renders
            TemplateError = TypeError
        try:
            rendered = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
            )
        except (TemplateError, TypeError, ValueError) as err:    # ValueError: transformers' own checks
            raise InputError(f"the chat template cannot render these messages: {type(err).__name__}: {err}") from err
        if not isinstance(rendered, str):
            raise InputError(f"the chat template rendered {type(rendered).__name__}, not text (check template_kwargs)")
        return rendered


def _split_rendered(rendered: str, parts: list[Segment]) -> list[Segment] | None:
    """Split at placeholders: glue, part 0, glue, part 1, ... Returns None if they are not all there in order."""
    segments: list[Segment] = []
    cursor = 0
    expected = 0
    for match in _PLACEHOLDER_RE.finditer(rendered):
        if int(match.group(1)) != expected:
            return None
        if match.start() > cursor:
            segments.append(Segment(rendered[cursor:match.start()], "glue"))
        if parts[expected].text:
            segments.append(parts[expected])
        cursor = match.end()
        expected += 1
    if expected != len(parts):
        return None
    if cursor < len(rendered):
        segments.append(Segment(rendered[cursor:], "glue"))
    return segments
