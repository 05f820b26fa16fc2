"""Tool calls in the model's own format, framework-neutral: which format a chat template uses, the
grammar of a forced call, the calls found in a reply, and streaming text held back once a call begins.
Used by the framework classes (kvboost_integrations) and by our server (serve/tools.py).

Formats (read from the chat template; the model was trained on what its template writes):
- "hermes": `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (Qwen2.5, Hermes, and
  our prompt for templates without tools, such as SmolLM2's).
- "llama3_json": the reply is `{"name": ..., "parameters": {...}}` (Llama 3.1/3.2 custom tools).
- "mistral": `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (Mistral v3 templates).
A reply is parsed for its template's format; forced calls are generated in it by constrained
decoding (`TaggedJson`), so they always parse.
"""
from __future__ import annotations

import hashlib
import json
import re
import uuid
from dataclasses import dataclass

from .constrained import TaggedJson
from .errors import InputError

NO_ARGUMENTS = {"type": "object", "properties": {}}
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ToolFormat:
    """How one family of chat templates writes tool calls."""

    name: str
    native: bool            # the chat template renders the `tools` list itself
    prefix: str             # text before the call(s)
    suffix: str             # text after them
    arguments_key: str      # "arguments" or "parameters"
    as_list: bool = False   # calls are a JSON list (Mistral)

    def forced_call(self, tools: dict[str, dict]) -> TaggedJson:
        """The grammar of exactly one call to one of `tools` (name -> parameters schema). A parameters
        schema with `$ref`s ("#/$defs/X", "#" itself) goes to the root's `$defs` as `tool_<i>`, its
        refs rebased there: nested in the call's wrapper they would resolve against the wrapper."""
        bodies, defs = [], {}
        for index, (name, params) in enumerate(tools.items()):
            arguments = params or NO_ARGUMENTS
            if _local_refs(arguments):
                defs[f"tool_{index}"] = _rebased(arguments, f"#/$defs/tool_{index}")
                arguments = {"$ref": f"#/$defs/tool_{index}"}
            bodies.append({"type": "object", "properties": {"name": {"const": name}, self.arguments_key: arguments},
                           "required": ["name", self.arguments_key]})
        body = bodies[0] if len(bodies) == 1 else {"anyOf": bodies}
        if self.as_list:
            body = {"type": "array", "items": body, "minItems": 1, "maxItems": 1}
        if defs:
            body = {**body, "$defs": {**body.get("$defs", {}), **defs}}
        return TaggedJson(self.prefix, body, self.suffix)

    def call_start(self, text: str) -> int | None:
        """Where the first call begins in `text`, if it does."""
        if self.name == "llama3_json":
            stripped = len(text) - len(text.lstrip())
            rest = text[stripped:]
            return stripped if rest.startswith(("{", PYTHON_TAG)) else None
        at = text.find(self.marker)
        return at if at >= 0 else None

    def held_back(self, text: str) -> int:
        """How many trailing characters of `text` could still turn into the start of a call."""
        if self.name == "llama3_json":
            return len(text) if not text.strip() or PYTHON_TAG.startswith(text.strip()) else 0
        for size in range(min(len(self.marker) - 1, len(text)), 0, -1):
            if text.endswith(self.marker[:size]):
                return size
        return 0

    @property
    def marker(self) -> str:
        return self.prefix.strip() if self.prefix.strip() else "{"

    def parse(self, text: str) -> tuple[str, list[dict]]:
        """The reply's plain text and its calls: dicts with name (None when unreadable), args (a
        JSON string, possibly invalid) and id."""
        start = self.call_start(text)
        if start is None:
            return text, []
        content, body = text[:start].rstrip(), text[start:]
        if self.name == "hermes":
            calls = _hermes_calls(body)
        elif self.name == "mistral":
            calls = _json_calls(body[len(self.marker):])
        else:
            calls = _json_calls(body.removeprefix(PYTHON_TAG) if body.startswith(PYTHON_TAG) else body)
            if not calls or calls[0]["name"] is None or not (calls[0].get("keyed") or body.startswith(PYTHON_TAG)):
                return text, []         # not a call after all: an answer in JSON ({"name": "Alice", "age": 30})
        for call in calls:
            call.pop("keyed", None)
        return content, calls


def _local_refs(node) -> bool:
    """Whether a schema holds a `$ref` into itself ("#...")."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        return (isinstance(ref, str) and ref.startswith("#")) or any(_local_refs(v) for v in node.values())
    return isinstance(node, list) and any(_local_refs(v) for v in node)


def _rebased(node, base: str):
    """A copy of a schema whose "#..." refs point under `base` (where the schema now sits)."""
    if isinstance(node, dict):
        return {k: (base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _rebased(v, base))
                for k, v in node.items()}
    if isinstance(node, list):
        return [_rebased(v, base) for v in node]
    return node


PYTHON_TAG = "<|python_tag|>"
HERMES = ToolFormat("hermes", False, "<tool_call>\n", "\n</tool_call>", "arguments")
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
FORMATS = {
    "hermes": ToolFormat("hermes", True, "<tool_call>\n", "\n</tool_call>", "arguments"),
    "llama3_json": ToolFormat("llama3_json", True, "", "", "parameters"),
    "mistral": ToolFormat("mistral", True, "[TOOL_CALLS] ", "", "arguments", as_list=True),
}


def tool_format(tokenizer) -> ToolFormat:
    """The tool-call format of a tokenizer's chat template (Hermes with our prompt when the template
    does not render tools)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = " ".join(template.values())
    if "tools" not in template:
        return HERMES
    if "[TOOL_CALLS]" in template:
        return FORMATS["mistral"]
    if "<tool_call>" in template:
        return FORMATS["hermes"]
    if '"parameters"' in template or PYTHON_TAG in template or "ipython" in template:
        return FORMATS["llama3_json"]
    return FORMATS["hermes"]


def normalize_tool_choice(tool_choice, names: list[str]) -> str:
    """None/"auto" -> "auto"; "none" -> "none"; "any"/"required"/True -> "any"; a tool name (or an
    OpenAI-style {"function": {"name": ...}}) -> that name."""
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


def parameters_problem(parameters) -> str | None:
    """Why a tool's `parameters` cannot describe a call's arguments (a JSON object), or None."""
    if parameters is None:
        return None
    if not isinstance(parameters, dict):
        return "parameters must be a JSON schema object"
    kind = parameters.get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        return f"parameters must be an object schema (a call's arguments are a JSON object), got type {kind!r}"
    return None


def forced_tools(tools: list[dict], choice: str) -> dict[str, dict]:
    """Name -> parameters schema of the OpenAI tool dicts a forced `choice` ("any" or a name) allows
    (InputError for two tools of one name: a call could not say which it means)."""
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) < len(names):
        raise InputError(f"two tools are named {next(n for n in names if names.count(n) > 1)!r}: a call names its tool")
    for tool in tools:
        if (reason := parameters_problem(tool["function"].get("parameters"))) is not None:
            raise InputError(f"tool {tool['function']['name']!r}: {reason}")
    return {t["function"]["name"]: t["function"].get("parameters") for t in tools
            if choice == "any" or t["function"]["name"] == choice}


def tool_prompt(tools: list[dict]) -> str:
    """System text describing `tools` (OpenAI tool dicts) and how to call them (Hermes format), for
    chat templates that do not render tools."""
    specs = "\n".join(json.dumps(tool["function"], ensure_ascii=False) for tool in tools)
    return ("You can call these tools:\n<tools>\n" + specs + "\n</tools>\n"
            "To call a tool, reply with:\n<tool_call>\n"
            '{"name": <tool name>, "arguments": <arguments as a JSON object>}\n</tool_call>')


def add_tool_prompt(messages: list[dict], tools: list[dict]) -> list[dict]:
    """Put the tool description in the system message (a part of its own, after the user's text)."""
    part = {"type": "text", "text": tool_prompt(tools)}
    if messages and messages[0]["role"] == "system":
        content = messages[0]["content"]
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else list(content)
        return [{**messages[0], "content": [*parts, part]}, *messages[1:]]
    return [{"role": "system", "content": [part]}, *messages]


def calls_as_text(calls: list[tuple[str, dict]]) -> str:
    """(name, arguments) calls as the Hermes text our tool prompt asks for: one block each."""
    return "\n".join("<tool_call>\n" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
                     + "\n</tool_call>" for name, args in calls)


def native_call(name: str, args: dict, call_id: str | None) -> dict:
    """One call as HF chat templates read it (arguments as a dict, id made template-safe)."""
    return {"id": native_call_id(call_id), "type": "function", "function": {"name": name, "arguments": args}}


def native_call_id(call_id: str | None) -> str:
    """A 9-character alphanumeric id for a call id (Mistral's templates accept no other), the same
    for the call and for its result; one already of that form is kept (so mapping twice, by a client
    and by our server, gives the id the local engine uses)."""
    if isinstance(call_id, str) and len(call_id) == 9 and call_id.isascii() and call_id.isalnum():
        return call_id
    return hashlib.sha1((call_id or "").encode()).hexdigest()[:9]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(body: str) -> dict:
    try:
        data, _ = _DECODER.raw_decode(body.strip())     # a whole call, whatever junk a small model left after it
    except json.JSONDecodeError:
        name = re.search(r'"name"\s*:\s*"([^"]*)"', body)
        return {"name": name.group(1) if name else None, "args": body, "id": new_call_id(),
                "keyed": re.search(r'"(arguments|parameters)"\s*:', body) is not None}
    return _from_json(data) or {"name": None, "args": body, "id": new_call_id()}


def _hermes_calls(text: str) -> list[dict]:
    """The calls of `<tool_call>` blocks: each one's JSON read whole after its marker (a `</tool_call>`
    inside a string argument is part of the argument, not the block's end), then its closing tag; a
    block whose JSON does not read is an unreadable call up to its closing tag (or the end)."""
    calls, at = [], text.find(_OPEN)
    while at >= 0:
        start = at + len(_OPEN)
        position = len(text) - len(text[start:].lstrip())         # the call's JSON, after any whitespace
        try:
            data, end = _DECODER.raw_decode(text, position)
        except json.JSONDecodeError:
            close = text.find(_CLOSE, start)
            end = close if close >= 0 else len(text)
            calls.append(_call(text[start:end].strip()))
        else:
            calls.append(_from_json(data) or {"name": None, "args": text[position:end], "id": new_call_id()})
            close = text.find(_CLOSE, end)       # junk a small model left between the call and its tag is skipped
            opens = text.find(_OPEN, end)
            end = close if close >= 0 and (opens < 0 or close < opens) else end
        at = text.find(_OPEN, end)
    return calls


def _from_json(data) -> dict | None:
    """A call from a decoded JSON object with a `name`; `keyed`: it also has `arguments` or `parameters`
    (llama3_json tells a call from an answer in JSON by it)."""
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    args = data.get("arguments", data.get("parameters", {}))
    return {"name": data["name"], "args": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
            "id": new_call_id(), "keyed": "arguments" in data or "parameters" in data}


def _json_calls(text: str) -> list[dict]:
    """Calls in JSON values one after another (a list of calls, objects separated by `;` or space)."""
    calls, position, text = [], 0, text.strip()
    while position < len(text):
        try:
            value, position = _DECODER.raw_decode(text, position)
        except json.JSONDecodeError:         # cut short (max_tokens) or malformed: keep what is readable
            calls.append(_call(text[position:]))
            break
        for item in value if isinstance(value, list) else [value]:
            calls.append(_from_json(item) or {"name": None, "args": json.dumps(item), "id": new_call_id()})
        while position < len(text) and text[position] in " \n\t;,":
            position += 1
    return calls


class ToolCallSplitter:
    """Passes streamed text through until a tool call begins; holds back the rest for parsing."""

    def __init__(self, fmt: ToolFormat | None):
        self.format = fmt
        self.text = ""
        self.shown = 0

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.format is None:
            return self._show(len(self.text))
        start = self.format.call_start(self.text)
        if start is not None:
            return self._show(start)
        return self._show(len(self.text) - self.format.held_back(self.text))

    def finish(self, cut: bool = False) -> tuple[str, list[dict]]:
        """The text not shown yet, and the parsed tool calls. A reply `cut` short (max_tokens) has
        no calls: its unfinished call is returned as text, never repaired into a call."""
        if self.format is None or cut:
            return self._show(len(self.text)), []
        content, calls = self.format.parse(self.text)
        return self._show(max(self.shown, len(content))), calls

    def _show(self, end: int) -> str:
        delta = self.text[self.shown:end] if end > self.shown else ""
        self.shown = max(self.shown, end)
        return delta
