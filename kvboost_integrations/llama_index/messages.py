"""LlamaIndex ChatMessages <-> the engine's OpenAI-style messages, and the model tokenizer hook.

A message's text blocks become separate content parts (separate cached segments). Blocks
listed in `additional_kwargs[DOCUMENT_BLOCKS]` become document parts: text the cache may
reuse at any position (retrieved nodes). `document_message` builds such a message.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence

from llama_index.core.base.llms.types import ChatMessage, DocumentBlock, MessageRole, TextBlock

from kvboost_engine import InputError

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


def to_engine_messages(messages: Sequence[ChatMessage]) -> list[dict]:
    """LlamaIndex messages as the engine's messages (content parts keep their boundaries).

    `messages` must be a sequence (a list): LlamaIndex's callbacks read an iterator before it
    gets here, so a generator would arrive empty; it is refused with a message saying so.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InputError(f"messages must be a list of ChatMessage, got {type(messages).__name__}"
                         + (" (LlamaIndex's callbacks consume an iterator before KVBoost sees it: pass a list)"
                            if isinstance(messages, Iterator) else ""))
    return [_engine_message(message, index) for index, message in enumerate(messages)]


def _engine_message(message: ChatMessage, index: int) -> dict:
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
    parts = [part for part in parts if part is not None]
    if len(parts) == 1 and parts[0]["type"] == "text":
        return {"role": role, "content": parts[0]["text"]}
    return {"role": role, "content": parts or ""}


def _part(block, is_document: bool) -> dict | None:
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
