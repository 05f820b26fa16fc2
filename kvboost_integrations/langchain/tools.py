"""Tool calling for LangChain: tools into the prompt, tool choice, calls out as LangChain chunks.

Tools reach the model through its chat template when the template knows about tools (the
`tools` variable of HF chat templates); replies are parsed in that template's own format
(Hermes `<tool_call>`, Llama 3.x JSON, Mistral `[TOOL_CALLS]`, see `_toolcalls`). Otherwise
(SmolLM2-135M-Instruct, the default model) tools are described in a system message part asking
for the Hermes format. A forced call (`tool_choice` "any"/"required"/a name) is generated in the
format by constrained decoding, so it always parses.
"""
from __future__ import annotations

import json

from .._toolcalls import ToolFormat


def normalize_tool_choice(tool_choice, names: list[str]) -> str:
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
    """System text describing `tools` (OpenAI tool dicts) and how to call them (Hermes format)."""
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


def forced_tools(tools: list[dict], choice: str) -> dict[str, dict]:
    """Name -> parameters schema of the tools a forced `choice` ("any" or a name) allows."""
    return {t["function"]["name"]: t["function"].get("parameters") for t in tools
            if choice == "any" or t["function"]["name"] == choice}


def tool_call_chunks(calls: list[dict]) -> list[dict]:
    """Parsed calls as LangChain tool_call_chunk dicts."""
    return [{**call, "index": index, "type": "tool_call_chunk"} for index, call in enumerate(calls)]


def parse_tool_calls(text: str, fmt: ToolFormat) -> tuple[str, list[dict]]:
    """Split a reply into its plain text and its tool calls (LangChain tool_call_chunk dicts)."""
    content, calls = fmt.parse(text)
    return content, tool_call_chunks(calls)
