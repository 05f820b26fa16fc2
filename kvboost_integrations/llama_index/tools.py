"""Function calling for LlamaIndex: tools in, ToolSelections out, structured output parsed.

Tools reach the model through its chat template (or our Hermes tool prompt when the template
has no tools); replies are parsed in the template's own format and forced calls (tool_required,
a tool_choice) are generated in it by constrained decoding (see `kvboost_integrations._toolcalls`).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llama_index.core.base.llms.types import ChatMessage, ChatResponse, MessageRole, ToolCallBlock
from llama_index.core.llms.llm import ToolSelection
from pydantic import BaseModel

from .._toolcalls import normalize_tool_choice


def tool_specs(tools: Sequence[Any]) -> list[dict]:
    """OpenAI tool dicts for LlamaIndex tools (or tool dicts already)."""
    return [tool if isinstance(tool, dict) else tool.metadata.to_openai_tool() for tool in tools]


def tool_choice_for(specs: list[dict], tool_choice, tool_required: bool) -> str:
    """"auto", "any", "none" or a tool name; `tool_required` forces a call when no choice is given."""
    if tool_choice is None and tool_required:
        tool_choice = "required"
    return normalize_tool_choice(tool_choice, [spec["function"]["name"] for spec in specs])


def chat_messages(user_msg: str | ChatMessage | None, chat_history: Sequence[ChatMessage] | None) -> list[ChatMessage]:
    messages = list(chat_history or [])
    if isinstance(user_msg, str):
        user_msg = ChatMessage(role=MessageRole.USER, content=user_msg)
    return messages + ([user_msg] if user_msg is not None else [])


def tool_selections(response: ChatResponse) -> list[ToolSelection]:
    """The calls of a response; a call whose arguments are not a JSON object (the model's own malformed
    call) is a ValueError naming the tool, never run with {} (its defaults) in their place."""
    blocks = [block for block in response.message.blocks if isinstance(block, ToolCallBlock)]
    for block in blocks:
        if not isinstance(block.tool_kwargs, dict):
            raise ValueError(f"the call of tool {block.tool_name!r} has arguments that are not a JSON object: "
                             f"{block.tool_kwargs!r:.200}")
    return [ToolSelection(tool_id=block.tool_call_id or "", tool_name=block.tool_name, tool_kwargs=block.tool_kwargs)
            for block in blocks]


def keep_first_call(response: ChatResponse) -> ChatResponse:
    """Drop all calls but the first (when parallel calls are not allowed)."""
    calls = [block for block in response.message.blocks if isinstance(block, ToolCallBlock)]
    for extra in calls[1:]:
        response.message.blocks.remove(extra)
    listed = response.message.additional_kwargs.get("tool_calls")
    if isinstance(listed, list) and len(listed) > 1:        # the same calls, as LlamaIndex core reads them
        response.message.additional_kwargs["tool_calls"] = listed[:1]
    return response


def parse_structured(output_cls: type[BaseModel], response: ChatResponse) -> BaseModel:
    """The Pydantic object of a constrained reply; a reply cut by max_new_tokens is an error that
    says so (never a silently truncated object)."""
    finish = ((response.raw or {}).get("kvboost") or {}).get("finish_reason")
    if finish == "length":                  # even a cut that happens to validate is not the whole answer
        spent = ((response.raw or {}).get("usage") or {}).get("completion_tokens")
        raise ValueError(f"the {output_cls.__name__} JSON was cut before it was complete: finish_reason='length' "
                         f"after {spent} tokens (the max_new_tokens budget); raise max_new_tokens")
    return output_cls.model_validate_json(response.message.content or "")
