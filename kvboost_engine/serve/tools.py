"""Tool calling over the wire: OpenAI's `tools` / `tool_choice` and tool messages, in the model's own
call format (`kvboost_engine.toolcalls`, the helpers ChatKVBoost and KVBoost use: the same prompt,
grammar and parser).

`prepare_tools` turns a request into what the engine runs: the messages (tool calls of earlier
assistant turns and tool results in the template's form; the tool list in the template, or our
tool prompt for templates without tools) and the parameters (a forced call is grammar-constrained,
so it always parses). `ToolReply` splits the generated text into content and calls as it streams.
"""
from __future__ import annotations

import json

from ..toolcalls import (ToolCallSplitter, add_tool_prompt, calls_as_text, forced_tools, native_call, native_call_id,
                         normalize_tool_choice, parameters_problem, tool_format)
from .protocol import BadRequest, Call

MAX_TOOLS = 128                 # OpenAI's limit


def prepare_tools(call: Call, tools, tool_choice, tokenizer):
    """Rewrite `call` (messages, template kwargs, params) for `tools`; returns the ToolFormat in use
    (None when no tool may be called)."""
    if tools is None and tool_choice is None and not any(_has_tool_fields(m) for m in call.payload):
        return None
    fmt = tool_format(tokenizer)
    call.payload = [_message(m, fmt.native) for m in call.payload]
    tools = _check_tools(tools)
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise BadRequest("tool_choice needs tools", "tool_choice")
        return None
    try:
        choice = normalize_tool_choice(tool_choice, [t["function"]["name"] for t in tools])
    except ValueError as err:
        raise BadRequest(str(err), "tool_choice") from None
    if choice == "none":
        return None
    if "constraint" in call.params:
        raise BadRequest("give tools or response_format, not both", "response_format")
    if fmt.native:
        call.template_kwargs = {**(call.template_kwargs or {}), "tools": tools}
    else:
        call.payload = add_tool_prompt(call.payload, tools)
    call.params["skip_special_tokens"] = False          # a call marker may be a special token
    if choice != "auto":
        if call.params.get("stop"):
            raise BadRequest("stop cannot be combined with a forced tool call (the grammar decides the end)", "stop")
        call.params["constraint"] = fmt.forced_call(forced_tools(tools, choice))
    return fmt


def _has_tool_fields(message: dict) -> bool:
    return bool(message.get("tool_calls")) or message.get("role") == "tool"


def _check_tools(tools) -> list[dict]:
    if tools is None:
        return []
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise BadRequest(f"tools must be a list of at most {MAX_TOOLS} function tools", "tools")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict)
                or not isinstance(function.get("name"), str)):
            raise BadRequest(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': "
                             "{...}}}", f"tools[{i}]")
        if (reason := parameters_problem(function.get("parameters"))) is not None:
            raise BadRequest(f"tools[{i}].function.{reason}", f"tools[{i}].function.parameters")
        if function["name"] in names:
            raise BadRequest(f"tools[{i}] repeats the name {function['name']!r} (a call names its tool)", f"tools[{i}]")
        names.add(function["name"])
    return tools


def _message(message: dict, native: bool) -> dict:
    """One wire message with its tool fields in the form the chat template (or our prompt) reads."""
    out = {k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id", "name")}
    calls = message.get("tool_calls") or []
    if calls:
        pairs = [_call_pair(c) for c in calls]
        if native:
            out["tool_calls"] = [native_call(name, args, c.get("id")) for (name, args), c in zip(pairs, calls)]
        else:
            text = calls_as_text(pairs)
            content = out.get("content") or ""
            out["content"] = (f"{content}\n{text}" if content else text) if isinstance(content, str) \
                else [*content, {"type": "text", "text": text}]
    if message.get("role") == "tool" and native:
        out["tool_call_id"] = native_call_id(message.get("tool_call_id"))
    if message.get("name") and (native or message.get("role") != "tool"):
        out["name"] = message["name"]               # as the classes pass it (a template may render names)
    return out


def _call_pair(call) -> tuple[str, dict]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise BadRequest("an assistant message's tool_calls must be {'id', 'type': 'function', 'function': "
                         "{'name', 'arguments'}}", "messages.tool_calls")
    args = function.get("arguments") or "{}"
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        raise BadRequest(f"tool call arguments must be a JSON object, got {args!r:.80}",
                         "messages.tool_calls") from None
    return function["name"], args


class ToolReply:
    """Generated text -> content shown as it streams (held back once a call may begin) and calls
    (the first one only with `one_call`: parallel_tool_calls=false, as ChatKVBoost's bind_tools)."""

    def __init__(self, fmt, one_call: bool = False):
        self.splitter = ToolCallSplitter(fmt)
        self.one_call = one_call

    def feed(self, delta: str) -> str:
        return self.splitter.feed(delta)

    def finish(self, cut: bool) -> tuple[str, list[dict]]:
        """(text not shown yet, calls as OpenAI's tool_calls); a reply cut by max_tokens has no calls,
        and a reply with an unreadable call (no name, or arguments that are not a JSON object) keeps
        all its text."""
        before = self.splitter.shown
        rest, calls = self.splitter.finish(cut)
        calls = calls[:1] if self.one_call else calls       # a later call, kept or not, is dropped either way
        if any(c["name"] is None or not _json_object(c["args"]) for c in calls):
            return self.splitter.text[before:], []
        return rest, [{"index": i, "id": c["id"], "type": "function",
                       "function": {"name": c["name"], "arguments": c["args"]}}
                for i, c in enumerate(calls)]


def _json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False
