"""LangChain messages -> the engine's OpenAI-style message dicts, one segment per block.

The system message, every human/AI/tool message and every content block of a message become
separate engine segments (cache chunk boundaries). Text blocks marked as documents (see
`document_block`) become engine "document" parts: reusable wherever they appear.
"""
from __future__ import annotations

from collections.abc import Sequence

from langchain_core.messages import (AIMessage, BaseMessage, ChatMessage, FunctionMessage, HumanMessage,
                                     SystemMessage, ToolMessage)

from .._toolcalls import calls_as_text, native_call, native_call_id

DOCUMENT_FLAG = "kvboost_document"
_ROLES = {"human": "user", "user": "user", "ai": "assistant", "assistant": "assistant",
          "system": "system", "developer": "system", "tool": "tool", "function": "tool"}
_SKIPPED_BLOCKS = {"tool_use", "tool_call", "invalid_tool_call", "tool_call_chunk", "thinking", "reasoning",
                   "redacted_thinking"}


def document_block(text: str) -> dict:
    """A text content block that ChatKVBoost treats as a retrieved document (reusable anywhere).

    It is an ordinary LangChain text block with a marker under `extras`; other chat models
    read it as plain text.
    """
    return {"type": "text", "text": text, "extras": {DOCUMENT_FLAG: True}}


def is_document_block(block) -> bool:
    return isinstance(block, dict) and bool((block.get("extras") or {}).get(DOCUMENT_FLAG))


def to_engine_messages(messages: Sequence[BaseMessage], *, native_tools: bool) -> list[dict]:
    """Convert messages; with `native_tools`, tool calls and tool results keep their structured
    fields for a tool-aware chat template (ids as 9 alphanumerics: Mistral's templates accept no
    other), otherwise tool calls are written out as text."""
    return [_convert(message, native_tools) for message in messages]


def _convert(message: BaseMessage, native_tools: bool) -> dict:
    role = _role(message)
    out: dict = {"role": role, "content": _content(message.content)}
    if isinstance(message, AIMessage) and (reasoning := reasoning_of(message)):
        out["reasoning_content"] = reasoning          # the template keeps or drops it (Qwen3: only after the last question)
    if isinstance(message, AIMessage) and message.tool_calls:
        if native_tools:
            out["tool_calls"] = [native_call(c["name"], c["args"], c.get("id")) for c in message.tool_calls]
        else:
            out["content"] = _append_text(out["content"], tool_calls_as_text(message.tool_calls))
    if isinstance(message, ToolMessage) and native_tools:
        out["tool_call_id"] = native_call_id(message.tool_call_id)
    if message.name and (native_tools or not isinstance(message, ToolMessage)):
        out["name"] = message.name                    # as ChatOpenAI sends it; templates that render names use it
    return out


def reasoning_of(message: AIMessage) -> str:
    """An AI message's thinking: `additional_kwargs["reasoning_content"]` (what ChatKVBoost and
    langchain-ollama write), else its reasoning / thinking content blocks."""
    given = message.additional_kwargs.get("reasoning_content")
    if isinstance(given, str):
        return given
    blocks = message.content if isinstance(message.content, list) else []
    return "\n".join(block.get("reasoning") or block.get("thinking") or "" for block in blocks
                     if isinstance(block, dict) and block.get("type") in ("reasoning", "thinking")).strip()


_CLASSES = ((SystemMessage, "system"), (HumanMessage, "human"), (AIMessage, "ai"), (ToolMessage, "tool"),
            (FunctionMessage, "function"))


def _role(message: BaseMessage) -> str:
    """The message's role; a chunk class (AIMessageChunk: a streamed reply added up, as a history
    keeps it) has its message class's role (its `type` names the chunk class)."""
    if isinstance(message, ChatMessage):
        role = message.role
    else:
        role = next((kind for cls, kind in _CLASSES if isinstance(message, cls)), getattr(message, "type", None))
    if role not in _ROLES:
        raise ValueError(f"ChatKVBoost cannot send a message of role {role!r}; use system, human, ai or tool")
    return _ROLES[role]


def _content(content) -> str | list[dict]:
    """A string stays a string; a list becomes one engine part per text block."""
    if isinstance(content, str):
        return content
    parts = []
    for index, block in enumerate(content):
        if isinstance(block, str):
            parts.append({"type": "text", "text": block})
        elif not isinstance(block, dict):
            raise ValueError(f"content block {index} must be a string or a dict, got {type(block).__name__}")
        elif block.get("type") == "text":
            if not isinstance(block.get("text"), str):
                raise ValueError(f"content block {index} is a text block without a 'text' string: {block!r:.120}")
            kind = "document" if is_document_block(block) else "text"
            parts.append({"type": kind, "text": block["text"]})
        elif block.get("type") not in _SKIPPED_BLOCKS:
            raise ValueError(f"ChatKVBoost reads text only; got a content block of type {block.get('type')!r}")
    return parts if parts else ""


def _append_text(content: str | list[dict], text: str) -> str | list[dict]:
    if isinstance(content, str):
        return f"{content}\n{text}" if content else text
    return [*content, {"type": "text", "text": text}]


def tool_calls_as_text(tool_calls) -> str:
    """Tool calls as the model is asked to write them: one <tool_call> block each."""
    return calls_as_text([(c["name"], c["args"]) for c in tool_calls])
