"""Tool calling: tools into the prompt, tool calls out of the reply.

Tools reach the model through its chat template when the template knows about tools (the
`tools` variable of HF chat templates). Otherwise (SmolLM2-135M-Instruct, the default model)
they are described in a system message part, asking for the widespread
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` format. Replies are parsed for that
format; a forced tool call (`tool_choice` "any"/"required"/a name) is written in it by
constrained decoding, so it always parses.
"""
from __future__ import annotations

import json
import re
import uuid

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
_CALL_RE = re.compile(re.escape(TOOL_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(TOOL_CLOSE) + r"|$)", re.S)


def template_supports_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders a `tools` list."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = " ".join(template.values())
    return "tools" in template


def normalize_tool_choice(tool_choice, names: list[str]) -> str | None:
    """None/"auto" -> "auto"; "none" -> "none"; "any"/"required"/True -> "any"; a tool name -> that name."""
    if tool_choice in (None, "auto", False):
        return "auto"
    if tool_choice in ("any", "required", True):
        return "any"
    if tool_choice == "none":
        return "none"
    if isinstance(tool_choice, dict):
        tool_choice = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
    if isinstance(tool_choice, str) and tool_choice in names:
        return tool_choice
    raise ValueError(f"tool_choice must be 'auto', 'none', 'any', 'required' or one of {names}, got {tool_choice!r}")


def tool_prompt(tools: list[dict]) -> str:
    """System text describing `tools` (OpenAI tool dicts) and how to call them."""
    specs = "\n".join(json.dumps(tool["function"], ensure_ascii=False) for tool in tools)
    return ("You can call these tools:\n<tools>\n" + specs + "\n</tools>\n"
            "To call a tool, reply with:\n" + TOOL_OPEN
            + '\n{"name": <tool name>, "arguments": <arguments as a JSON object>}\n' + TOOL_CLOSE)


def add_tool_prompt(messages: list[dict], tools: list[dict]) -> list[dict]:
    """Put the tool description in the system message (a part of its own, after the user's text)."""
    part = {"type": "text", "text": tool_prompt(tools)}
    if messages and messages[0]["role"] == "system":
        content = messages[0]["content"]
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
        return [{**messages[0], "content": [*parts, part]}, *messages[1:]]
    return [{"role": "system", "content": [part]}, *messages]


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """Split a reply into its plain text and its tool calls (LangChain tool_call_chunk dicts)."""
    start = text.find(TOOL_OPEN)
    if start < 0:
        return text, []
    calls = []
    for index, match in enumerate(_CALL_RE.finditer(text, start)):
        name, args = _name_and_args(match.group(1))
        calls.append({"name": name, "args": args, "id": f"call_{uuid.uuid4().hex[:24]}", "index": index,
                      "type": "tool_call_chunk"})
    return text[:start].rstrip(), calls


def _name_and_args(body: str) -> tuple[str | None, str]:
    """Name and arguments (a JSON string, possibly invalid) of one call body."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        name = re.search(r'"name"\s*:\s*"([^"]*)"', body)
        return (name.group(1) if name else None), body
    if not isinstance(data, dict):
        return None, body
    args = data.get("arguments", data.get("parameters", {}))
    return data.get("name"), args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


class ToolCallSplitter:
    """Passes streamed text through until a tool call begins; holds back the rest for parsing."""

    def __init__(self, active: bool):
        self.active = active
        self.text = ""
        self.shown = 0

    def feed(self, delta: str) -> str:
        self.text += delta
        if not self.active:
            return self._show(len(self.text))
        start = self.text.find(TOOL_OPEN)
        if start >= 0:
            return self._show(start)
        return self._show(len(self.text) - _partial_marker(self.text))

    def finish(self) -> tuple[str, list[dict]]:
        """The text not shown yet, and the parsed tool calls."""
        if not self.active:
            return self._show(len(self.text)), []
        content, calls = parse_tool_calls(self.text)
        return self._show(max(self.shown, len(content))), calls

    def _show(self, end: int) -> str:
        delta = self.text[self.shown:end] if end > self.shown else ""
        self.shown = max(self.shown, end)
        return delta


def _partial_marker(text: str) -> int:
    """Length of the longest tail of `text` that starts the tool-call marker."""
    for size in range(min(len(TOOL_OPEN) - 1, len(text)), 0, -1):
        if text.endswith(TOOL_OPEN[:size]):
            return size
    return 0
