"""Tool calls as LangChain wants them. Tools reach the model through its chat template when the
template renders tools, otherwise through our Hermes-format tool prompt; replies are parsed in the
template's own format and forced calls are generated in it (see `kvboost_integrations._toolcalls`).
"""
from __future__ import annotations

from .._toolcalls import ToolFormat


def tool_call_chunks(calls: list[dict]) -> list[dict]:
    """Parsed calls as LangChain tool_call_chunk dicts."""
    return [{**call, "index": index, "type": "tool_call_chunk"} for index, call in enumerate(calls)]


def parse_tool_calls(text: str, fmt: ToolFormat) -> tuple[str, list[dict]]:
    """Split a reply into its plain text and its tool calls (LangChain tool_call_chunk dicts)."""
    content, calls = fmt.parse(text)
    return content, tool_call_chunks(calls)
