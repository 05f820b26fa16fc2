"""LlamaIndex ChatMessages <-> the engine's OpenAI-style messages, and the model tokenizer hook.

A message's text blocks become separate content parts (separate cached segments). Blocks
listed in `additional_kwargs[DOCUMENT_BLOCKS]` become document parts: text the cache may
reuse at any position (retrieved nodes). `document_message` builds such a message.
"""
from __future__ import annotations

import json
from collections.abc import Iterator, Sequence

from llama_index.core.base.llms.types import ChatMessage, DocumentBlock, MessageRole, TextBlock, ToolCallBlock

from kvboost_engine import InputError

from .._toolcalls import calls_as_text, native_call, native_call_id

# additional_kwargs key: indexes of the message's blocks that are documents (retrieved nodes).
DOCUMENT_BLOCKS = "kvboost_document_blocks"

_ROLES = {
    MessageRole.SYSTEM: "system", MessageRole.DEVELOPER: "system",
    MessageRole.USER: "user",
    MessageRole.ASSISTANT: "assistant", MessageRole.CHATBOT: "assistant", MessageRole.MODEL: "assistant",
    MessageRole.TOOL: "tool", MessageRole.FUNCTION: "tool",
}


def document_message(role: MessageRole | str, texts: Sequence[tuple[str, bool]]) -> ChatMessage:
    """A message whose blocks are `texts` in order; those flagged True are document parts."""
    blocks = [TextBlock(text=text) for text, _ in texts]
    documents = [i for i, (_, is_document) in enumerate(texts) if is_document]
    kwargs = {DOCUMENT_BLOCKS: documents} if documents else {}
    return ChatMessage(role=role, blocks=blocks, additional_kwargs=kwargs)


def to_engine_messages(messages: Sequence[ChatMessage], *, native_tools: bool = False) -> list[dict]:
    """LlamaIndex messages as the engine's messages (content parts keep their boundaries). Tool
    calls (ToolCallBlocks) and tool results go to a tool-aware chat template as structured fields
    with `native_tools`, otherwise the calls are written out as `<tool_call>` text.

    `messages` must be a sequence (a list): LlamaIndex's callbacks read an iterator before it
    gets here, so a generator would arrive empty; it is refused with a message saying so.
    """
    check_messages(messages)
    return [_engine_message(message, index, native_tools) for index, message in enumerate(messages)]


def check_messages(messages) -> None:
    """InputError unless `messages` is a sequence (an iterator arrives consumed by LlamaIndex's callbacks)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InputError(f"messages must be a list of ChatMessage, got {type(messages).__name__}"
                         + (" (LlamaIndex's callbacks consume an iterator before KVBoost sees it: pass a list)"
                            if isinstance(messages, Iterator) else ""))


def _engine_message(message: ChatMessage, index: int, native_tools: bool) -> dict:
    if not isinstance(message, ChatMessage):
        raise InputError(f"message {index} must be a ChatMessage, got {type(message).__name__} ({message!r:.60})")
    role = _ROLES.get(MessageRole(message.role))
    if role is None:                # pragma: no cover - every MessageRole is mapped
        raise InputError(f"unsupported message role {message.role!r}")
    if not message.blocks and role != "assistant":     # an assistant turn may carry only tool calls
        raise InputError(f"message {index} (role {role!r}) has no content: ChatMessage(content=...) takes a "
                         "string or a list of blocks, and LlamaIndex drops any other content (None, a number) "
                         "without a word")
    documents = set(message.additional_kwargs.get(DOCUMENT_BLOCKS, ()))
    parts = [_part(block, position in documents) for position, block in enumerate(message.blocks)]
    parts = [part for part in parts if part is not None and part != {"type": "text", "text": ""}]   # (the empty
    # text block of a reply that is only tool calls: as a part of its own it added "\n\n" the model never wrote)
    calls = tool_calls_of(message)
    if calls and not native_tools:
        parts.append({"type": "text", "text": calls_as_text([(name, args) for name, args, _ in calls])})
    if len(parts) == 1 and parts[0]["type"] == "text":
        out = {"role": role, "content": parts[0]["text"]}
    else:
        out = {"role": role, "content": parts or ""}
    thinking = "\n".join(b.content or "" for b in message.blocks if type(b).__name__ == "ThinkingBlock").strip()
    if thinking and role == "assistant":
        out["reasoning_content"] = thinking     # the template keeps or drops it (Qwen3: only after the last question)
    if calls and native_tools:
        out["tool_calls"] = [native_call(name, args, call_id) for name, args, call_id in calls]
    if role == "tool" and native_tools:
        out["tool_call_id"] = native_call_id(message.additional_kwargs.get("tool_call_id"))
    name = message.additional_kwargs.get("name")
    if isinstance(name, str) and name and (native_tools or role != "tool"):
        out["name"] = name                            # as LlamaIndex's OpenAI sends it; templates that render names use it
    return out


def tool_calls_of(message: ChatMessage) -> list[tuple[str, dict, str | None]]:
    """(name, arguments, id) of the calls in a message: ToolCallBlocks, else OpenAI-style dicts
    under additional_kwargs["tool_calls"]."""
    calls = [(b.tool_name, _arguments(b.tool_kwargs), b.tool_call_id) for b in message.blocks
             if isinstance(b, ToolCallBlock)]
    if not calls:
        for call in message.additional_kwargs.get("tool_calls") or ():
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and function.get("name"):
                calls.append((function["name"], _arguments(function.get("arguments")), call.get("id")))
    return calls


def _arguments(args) -> dict:
    if isinstance(args, dict):
        return args
    try:
        parsed = json.loads(args) if isinstance(args, str) else {}
    except json.JSONDecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _part(block, is_document: bool) -> dict | None:
    if isinstance(block, ToolCallBlock):
        return None                 # written by _engine_message, as the template wants it
    if isinstance(block, TextBlock):
        return {"type": "document" if is_document else "text", "text": block.text}
    if isinstance(block, DocumentBlock) and (block.document_mimetype or "").startswith("text/"):
        return {"type": "document", "text": block.resolve_document().read().decode("utf-8")}
    if type(block).__name__ in ("ThinkingBlock", "CachePoint"):
        return None                 # reasoning traces and provider cache hints: not prompt text
    raise InputError(f"KVBoost takes text only; a {type(block).__name__} cannot be sent to the model")


class ModelTokenizer:
    """`text -> token ids` with the model's own tokenizer (no special tokens).

    Use it where LlamaIndex counts tokens: `Settings.tokenizer = llm.tokenizer`, or
    `PromptHelper(..., tokenizer=llm.tokenizer)`.
    """

    def __init__(self, hf_tokenizer):
        self.hf_tokenizer = hf_tokenizer

    def __call__(self, text: str) -> list[int]:
        return list(self.hf_tokenizer(text, add_special_tokens=False)["input_ids"])
