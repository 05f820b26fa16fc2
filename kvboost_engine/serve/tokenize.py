"""POST /tokenize in vLLM's shape, so remote clients count tokens exactly as the engine will.

    {"prompt": "text", "add_special_tokens": false}               -> the text's token ids
    {"messages": [...], "add_generation_prompt": true, "tools": [...], "chat_template_kwargs": {...}}
                                                                   -> the chat prompt's token ids
Answer: {"tokens": [...], "count": n, "max_model_len": window}. Messages go through the same
rendering as /v1/chat/completions (document parts, tools), so `count` is that request's
`usage.prompt_tokens`.
"""
from __future__ import annotations

from ..engine import Engine
from .protocol import SWITCHES, BadRequest, Call, check_message, template_switches
from .tools import prepare_tools

TOKENIZE_FIELDS = ("model", "prompt", "add_special_tokens", "messages", "add_generation_prompt", "tools",
                   "chat_template_kwargs", "continue_final_message", "return_token_strs")


def tokenize(engine: Engine, body) -> dict:
    """The /tokenize answer for a request `body` (BadRequest naming a bad field)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - set(TOKENIZE_FIELDS))
    if unknown:
        raise BadRequest(f"unknown field {unknown[0]!r}", unknown[0])
    if ("prompt" in body) == ("messages" in body):
        raise BadRequest("give exactly one of prompt or messages", "prompt")
    if "prompt" in body:
        ids = _prompt_ids(engine, body)
    else:
        ids = _chat_ids(engine, body)
    return {"tokens": ids, "count": len(ids), "max_model_len": engine.context_window}


def _prompt_ids(engine: Engine, body: dict) -> list[int]:
    prompt, special = body["prompt"], body.get("add_special_tokens", True)
    if not isinstance(prompt, str):
        raise BadRequest("prompt must be a string", "prompt")
    if not isinstance(special, bool):
        raise BadRequest("add_special_tokens must be a boolean", "add_special_tokens")
    if special:
        return list(engine.encode_prompt(prompt).token_ids)
    return list(engine.tokenizer(prompt, add_special_tokens=False)["input_ids"])


def _chat_ids(engine: Engine, body: dict) -> list[int]:
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of message objects", "messages")
    for i, message in enumerate(messages):
        check_message(message, f"messages[{i}]")
    template_kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(template_kwargs, dict):
        raise BadRequest("chat_template_kwargs must be an object", "chat_template_kwargs")
    template_kwargs = dict(template_switches(template_kwargs))  # its add_generation_prompt, as the chat route reads it
    switches = template_switches({name: body.get(name) for name in SWITCHES}, "")
    generation_prompt = template_kwargs.pop("add_generation_prompt", switches.get("add_generation_prompt", True))
    if switches.get("continue_final_message"):
        template_kwargs = {**template_kwargs, "continue_final_message": True}
    call = Call("chat", None, messages, template_kwargs=template_kwargs)
    prepare_tools(call, body.get("tools"), None, engine.tokenizer)
    prompt = engine.encode_messages(call.payload, add_generation_prompt=generation_prompt,
                                    **(call.template_kwargs or {}))
    return list(prompt.token_ids)

