"""Our request parameters as OpenAI-compatible request bodies (the fields vLLM, llama-server,
SGLang and our own server read): sampling, tools, response formats. No I/O."""
from __future__ import annotations

from kvboost_engine import InputError
from kvboost_engine.request.sampling import stop_strings

SAMPLING = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "min_new_tokens", "repetition_penalty",
            "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs")
# Engine.chat's own defaults, for a call that names neither (a server's would be sampling at 1.0 and,
# on vLLM, up to the whole window): RemoteEngine answers as Engine does
ENGINE_DEFAULTS = {"max_new_tokens": 256, "temperature": 0.0}


def sampling_body(params: dict) -> dict:
    """Our sampling parameters as request fields (top_k, not in OpenAI's API, goes in extra_body)."""
    unknown = sorted(set(params) - set(SAMPLING))
    if unknown:
        raise InputError(f"unknown sampling parameters {unknown}; accepted: {', '.join(SAMPLING)}")
    params = {**ENGINE_DEFAULTS, **params}
    body: dict = {"stream": True, "stream_options": {"include_usage": True}}
    if params.get("max_new_tokens") is not None:
        body["max_tokens"] = params["max_new_tokens"]
    for name in ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty"):
        if params.get(name) is not None:
            body[name] = params[name]
    stops = stop_strings(params.get("stop"))       # a string is one stop, as the engine reads it
    if stops:
        body["stop"] = list(stops)
    if params.get("logit_bias"):
        body["logit_bias"] = {str(token): bias for token, bias in dict(params["logit_bias"]).items()}
    # -1: no top-k cut, as every server we know reads it (vLLM, SGLang, llama-server: k <= 0; our own
    # server); 0 means the same to new vLLM and llama-server but is refused by SGLang and older vLLM.
    # Sent always: llama-server's own default is 40
    extra = {"top_k": params.get("top_k") or -1}
    if params.get("min_new_tokens"):
        extra["min_tokens"] = params["min_new_tokens"]
    if params.get("repetition_penalty") not in (None, 1.0):
        # vLLM reads repetition_penalty; llama-server reads repeat_penalty, over the last repeat_last_n
        # tokens (-1: all, transformers' definition); each server ignores the other's names
        extra.update(repetition_penalty=params["repetition_penalty"], repeat_penalty=params["repetition_penalty"],
                     repeat_last_n=-1)
    body["extra_body"] = extra
    return body


def chat_body(model: str, messages: list[dict], params: dict, *, tools: list[dict] | None = None,
              tool_choice=None, response_format: dict | None = None, template_kwargs: dict | None = None) -> dict:
    """The `chat.completions.create` arguments of one streamed request."""
    body = {"model": model, "messages": messages, **sampling_body(params)}
    if params.get("logprobs"):
        body.update(logprobs=True, top_logprobs=params.get("top_logprobs") or 0)
    if tools:
        body["tools"] = tools
        body["tool_choice"] = wire_tool_choice(tool_choice)
    if response_format is not None:
        body["response_format"] = wire_response_format(response_format)
    if template_kwargs:
        body["extra_body"]["chat_template_kwargs"] = dict(template_kwargs)
    return body


def completion_body(model: str, prompt: str, params: dict) -> dict:
    """The `completions.create` arguments of one streamed plain-text request."""
    body = {"model": model, "prompt": prompt, **sampling_body(params)}
    if params.get("logprobs"):
        body["logprobs"] = params.get("top_logprobs") or 0        # the completions API: how many alternatives
    return body


def wire_tool_choice(choice) -> str | dict:
    """Our tool choice ("auto", "none", "any", a tool name) as OpenAI's."""
    if choice in (None, "auto"):
        return "auto"
    if choice in ("none", "required"):
        return choice
    if choice == "any":
        return "required"
    if isinstance(choice, dict):
        return choice
    return {"type": "function", "function": {"name": choice}}


def wire_response_format(schema: dict) -> dict:
    """A JSON schema (or an OpenAI response_format) as OpenAI's response_format."""
    if schema.get("type") in ("json_schema", "json_object", "text") and "properties" not in schema:
        return schema
    return {"type": "json_schema",
            "json_schema": {"name": str(schema.get("title") or "response"), "schema": schema}}
