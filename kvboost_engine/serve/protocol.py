"""OpenAI request bodies -> one engine call: what to run (messages or a prompt) and its parameters.

Every field a request may carry is listed here; any other field, and a field of the wrong type,
is a `BadRequest` naming it (HTTP 400). Sampling fields are mapped onto the names
`SamplingParams.build` accepts in this engine (read from its signature when the server starts),
so a field the engine cannot honour is refused by name rather than ignored. Values are checked
here by the engine's own rules and refused under the field's name (`max_tokens`, not the engine's
`max_new_tokens`), with the field as the error's `param`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..constrained import AnyJson, JsonSchema
from ..errors import InputError
from ..request.sampling import SAMPLING_NAMES, SamplingParams

# OpenAI's (and vLLM's extension) field name -> the engine's parameter name
SAMPLING_FIELDS = {
    "max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens", "min_tokens": "min_new_tokens",
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "seed": "seed", "stop": "stop",
    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty", "logit_bias": "logit_bias",
}
# Accepted and without effect on the reply (the OpenAI API's bookkeeping fields; llama-server's
# penalty window, which our remote client sends next to repetition_penalty; checked below).
IGNORED_FIELDS = ("user", "metadata", "store", "service_tier", "safety_identifier",
                  "prompt_cache_key", "repeat_penalty", "repeat_last_n")
COMMON_FIELDS = ("model", "stream", "stream_options", "n", "logprobs", "top_logprobs", *SAMPLING_FIELDS,
                 *IGNORED_FIELDS)
CHAT_FIELDS = (*COMMON_FIELDS, "messages", "response_format", "tools", "tool_choice", "parallel_tool_calls",
               "chat_template_kwargs")
COMPLETION_FIELDS = (*COMMON_FIELDS, "prompt", "echo", "suffix", "best_of")
PART_TYPES = ("text", "document")
SWITCHES = ("add_generation_prompt", "continue_final_message")    # chat template booleans
DEFAULT_TEMPERATURE = 1.0           # OpenAI's default when a request does not say
MAX_STOPS, MAX_STOP_CHARS = 16, 1000   # each token is checked against every stop string (OpenAI allows 4)


class BadRequest(Exception):
    """A request the server refuses (HTTP `status`, 400 by default), naming the field `param`."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param = param
        self.status = status


@dataclass
class Call:
    """One engine call parsed from a request body."""

    kind: str                       # "chat" or "completion"
    model: str | None
    payload: object                 # messages (chat) or the prompt text (completion)
    params: dict = field(default_factory=dict)
    template_kwargs: dict | None = None
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    tools: list | None = None       # chat: OpenAI's tools and tool_choice, as sent (see tools.py)
    tool_choice: object = None
    one_call: bool = False          # chat: parallel_tool_calls=false, a reply's first tool call only
    budget_field: str | None = None  # the reply budget's field as the client named it (max_tokens...)


def engine_parameters() -> frozenset[str]:
    """The sampling parameter names this engine's `SamplingParams.build` accepts."""
    return SAMPLING_NAMES


def parse_chat(body, accepted: frozenset[str]) -> Call:
    """A /v1/chat/completions body as a Call (BadRequest naming the first bad field)."""
    body = _object(body, CHAT_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of message objects", "messages")
    for i, message in enumerate(messages):
        check_message(message, f"messages[{i}]")
    messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]   # OpenAI's new name
    call = _common(body, "chat", messages, accepted)
    call.tools, call.tool_choice = body.get("tools"), body.get("tool_choice")
    call.one_call = body.get("parallel_tool_calls") is not None and not _bool(body, "parallel_tool_calls")
    call.template_kwargs = _optional_object(body, "chat_template_kwargs")
    if call.template_kwargs and "chat_template" in call.template_kwargs:
        raise BadRequest("chat_template_kwargs.chat_template is not accepted: this server renders chats with its "
                         "model's own template", "chat_template_kwargs.chat_template")
    call.template_kwargs = template_switches(call.template_kwargs)
    constraint = response_constraint(body.get("response_format"))
    if constraint is not None:
        call.params["constraint"] = constraint
    if call.logprobs:
        top = _int(body, "top_logprobs", 0)
        if not 0 <= top <= 20:
            raise BadRequest(f"top_logprobs must be an int in [0, 20], got {top!r}", "top_logprobs")
        call.params.update(logprobs=True, top_logprobs=top)
    elif body.get("top_logprobs"):
        raise BadRequest("top_logprobs needs logprobs=true", "top_logprobs")
    return call


def template_switches(template_kwargs: dict | None, where: str = "chat_template_kwargs.") -> dict | None:
    """`template_kwargs` with its add_generation_prompt / continue_final_message checked as booleans (a
    string "false" reads as true in Jinja) and null ones left out (unset)."""
    if not template_kwargs:
        return template_kwargs
    for name in SWITCHES:
        if template_kwargs.get(name) is not None and not isinstance(template_kwargs[name], bool):
            raise BadRequest(f"{where}{name} must be a boolean", f"{where}{name}")
    return {k: v for k, v in template_kwargs.items() if v is not None or k not in SWITCHES}



def parse_completion(body, accepted: frozenset[str]) -> Call:
    """A /v1/completions body as a Call."""
    body = _object(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise BadRequest("prompt must be a string (one prompt per request)", "prompt")
    for name, neutral in (("echo", False), ("suffix", None), ("best_of", 1)):
        if body.get(name) not in (None, neutral):
            raise BadRequest(f"{name} is not supported by this server", name)
    if body.get("top_logprobs") is not None:      # it was accepted and ignored
        raise BadRequest("top_logprobs is the chat API's field; the completions API takes logprobs=<n>", "top_logprobs")
    call = _common(body, "completion", prompt, accepted)
    logprobs = body.get("logprobs")             # the completions API: how many alternatives, or null
    if logprobs is not None:
        if isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= 20:
            raise BadRequest(f"logprobs must be null or an int in [0, 20], got {logprobs!r}", "logprobs")
        call.logprobs = True
        call.params.update(logprobs=True, top_logprobs=logprobs)
    return call


def _common(body: dict, kind: str, payload, accepted: frozenset[str]) -> Call:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("model must be a string", "model")
    if body.get("n") not in (None, 1) or isinstance(body.get("n"), bool):
        raise BadRequest("n must be 1 (one choice per request)", "n")
    stream = _bool(body, "stream")
    options = _optional_object(body, "stream_options") or {}
    if set(options) - {"include_usage", "continuous_usage_stats"}:
        bad = sorted(set(options) - {"include_usage", "continuous_usage_stats"})[0]
        raise BadRequest(f"unknown stream_options field {bad!r}", f"stream_options.{bad}")
    for name in ("include_usage", "continuous_usage_stats"):
        if options.get(name) is not None and not isinstance(options[name], bool):
            raise BadRequest(f"stream_options.{name} must be a boolean", f"stream_options.{name}")
    if options and not stream:
        raise BadRequest("stream_options needs stream=true", "stream_options")
    if options.get("continuous_usage_stats"):
        raise BadRequest("stream_options.continuous_usage_stats is not supported by this server (include_usage "
                         "gives the usage in a last chunk)", "stream_options.continuous_usage_stats")
    _check_repeat_fields(body)
    params = sampling_params(body, accepted)
    logprobs = kind == "chat" and _bool(body, "logprobs")
    if logprobs and "logprobs" not in accepted:
        raise BadRequest("logprobs are not supported by this engine", "logprobs")
    budget = next((name for name in ("max_tokens", "max_completion_tokens") if body.get(name) is not None), None)
    return Call(kind, model, payload, params, stream=stream, include_usage=bool(options.get("include_usage")),
                logprobs=logprobs, budget_field=budget)


def sampling_params(body: dict, accepted: frozenset[str]) -> dict:
    """The engine's sampling parameters from the request's fields (absent and null fields left out)."""
    params: dict = {"temperature": DEFAULT_TEMPERATURE}
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        raise BadRequest("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
    for name, engine_name in SAMPLING_FIELDS.items():
        value = body.get(name)
        if value is None:
            continue
        if engine_name not in accepted:
            raise BadRequest(f"{name} is not supported by this engine", name)
        if name == "top_k" and value == -1 and not isinstance(value, bool):
            value = 0                   # vLLM's and SGLang's "off" (our remote client sends it), the engine's 0
        if name == "seed":
            value = _seed(value)
        stops = [value] if name == "stop" and isinstance(value, str) else value if name == "stop" else None
        if isinstance(stops, list) and (len(stops) > MAX_STOPS or any(
                isinstance(s, str) and len(s) > MAX_STOP_CHARS for s in stops)):
            raise BadRequest(f"stop takes at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters", "stop")
        _check_value(name, engine_name, value)
        params[engine_name] = value
    return params


def _seed(value):
    """OpenAI's seed is a signed 64-bit int (vLLM takes negatives): a negative one as the engine's
    unsigned seed (value % 2**64); a value that is not an int as it is, for the engine's own check."""
    if isinstance(value, bool) or not isinstance(value, int) or 0 <= value < 2**64:
        return value
    if not -2**63 <= value < 2**64:
        raise BadRequest(f"seed must be an int in [-2**63, 2**64), got {value!r}", "seed")
    return value % 2**64


def _check_value(name: str, engine_name: str, value) -> None:
    """The engine's own check of one field, refused under the name the client sent (`max_tokens` must be
    ..., param `max_tokens`), not the engine's (`max_new_tokens`, no param)."""
    try:
        SamplingParams.build(**{engine_name: value})
    except InputError as err:
        raise BadRequest(str(err).replace(engine_name, name, 1), name) from None


def response_constraint(response_format):
    """OpenAI's response_format as an engine grammar: json_schema -> JsonSchema, json_object -> AnyJson."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise BadRequest("response_format must be an object with a type", "response_format")
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return AnyJson()
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise BadRequest("response_format.json_schema.schema must be a JSON schema object",
                             "response_format.json_schema.schema")
        return JsonSchema(schema)
    raise BadRequest(f"response_format type must be text, json_object or json_schema, got {kind!r}",
                     "response_format.type")


def check_message(message, where: str) -> None:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise BadRequest(f"{where} must be an object with a role", where)
    content = message.get("content")
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise BadRequest(f"{where}.content must be a string or a list of content parts", f"{where}.content")
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in PART_TYPES or not isinstance(part.get("text"), str):
            raise BadRequest(f"{where}.content[{j}] must be a text or document part with a text string "
                             f"(got type {kind!r})", f"{where}.content[{j}]")


def _check_repeat_fields(body: dict) -> None:
    """llama-server's names, as our remote client sends them: only alongside the same repetition_penalty."""
    repeat = body.get("repeat_penalty")
    if repeat is not None and repeat != body.get("repetition_penalty"):
        raise BadRequest("repeat_penalty is llama-server's name: send repetition_penalty", "repeat_penalty")
    if body.get("repeat_last_n") not in (None, -1):
        raise BadRequest("repeat_last_n must be -1 (the penalty counts every token)", "repeat_last_n")


def _object(body, allowed: tuple[str, ...]) -> dict:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise BadRequest(f"unknown field {unknown[0]!r}", unknown[0])
    return body


def _optional_object(body: dict, name: str) -> dict | None:
    value = body.get(name)
    if value is not None and not isinstance(value, dict):
        raise BadRequest(f"{name} must be an object", name)
    return value


def _bool(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise BadRequest(f"{name} must be a boolean", name)
    return bool(value)


def _int(body: dict, name: str, default: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{name} must be an integer", name)
    return value
