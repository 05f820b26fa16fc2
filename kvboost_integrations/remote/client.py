"""One OpenAI-compatible server on the wire, through the maintained `openai` client.

`Replica` holds a server's URLs and its lazily built sync and async `openai` clients (retries
off: failing over to another replica is the engine's job). It also reads the server's
non-OpenAI endpoints (/metrics, /tokenize, /props) through the same clients. `chat_body` and
`completion_body` map our sampling parameters onto a request; `is_replica_failure` tells a
server that is down or broken (try another) from a request that is wrong (raise).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

from kvboost_engine import InputError

from .telemetry import PrefixCounters, parse_metrics, prefix_counters

SAMPLING = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop")
_FAILOVER_STATUS = (408, 429, 500, 502, 503, 504)


def _openai():
    try:
        import openai
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError('the remote backend needs the openai client: pip install "kvboost-integrations[remote]"') \
            from err
    return openai


@dataclass
class ServerInfo:
    """What a server says about itself: kind ("vllm", "llamacpp" or "openai"), model, window."""

    kind: str
    model: str
    context_window: int | None


class Replica:
    """An OpenAI-compatible endpoint: `url` is its /v1 base, `root` the server root."""

    def __init__(self, endpoint: str, *, api_key: str | None = None, timeout: float | None = None,
                 max_retries: int = 0):
        if not isinstance(endpoint, str) or not endpoint.startswith(("http://", "https://")):
            raise InputError(f"an endpoint must be an http(s) URL such as http://127.0.0.1:8000/v1, got {endpoint!r}")
        base = endpoint.rstrip("/")
        self.root = base[:-3] if base.endswith("/v1") else base
        self.url = self.root + "/v1"
        self.api_key = api_key or "none"
        self.timeout = timeout
        self.max_retries = max_retries
        self.reports_cached_tokens: bool | None = None   # learned from the first usage seen
        self._clients: dict[str, object] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Replica({self.url!r})"

    @property
    def client(self):
        """The sync `openai.OpenAI` client of this replica."""
        return self._client("sync")

    @property
    def aclient(self):
        """The `openai.AsyncOpenAI` client of this replica."""
        return self._client("async")

    def _client(self, kind: str):
        with self._lock:
            if kind not in self._clients:
                openai = _openai()
                cls = openai.OpenAI if kind == "sync" else openai.AsyncOpenAI
                self._clients[kind] = cls(base_url=self.url, api_key=self.api_key, max_retries=self.max_retries,
                                          timeout=self.timeout if self.timeout is not None else 600.0)
            return self._clients[kind]

    def get_json(self, path: str) -> dict:
        return self.client.get(self.root + path, cast_to=object)

    def post_json(self, path: str, body: dict) -> dict:
        return self.client.post(self.root + path, body=body, cast_to=object)

    def prefix_counters(self) -> PrefixCounters | None:
        """The server's prefix-cache counters now (None if /metrics is off or has none we know)."""
        try:
            text = self.client.get(self.root + "/metrics", cast_to=str)
        except _openai().APIError:
            return None
        return prefix_counters(parse_metrics(text))

    def info(self) -> ServerInfo:
        """Kind, first served model and context window, from /v1/models (and /props for llama.cpp)."""
        models = self.get_json("/v1/models").get("data") or []
        if not models:
            raise InputError(f"{self.url} serves no model")
        entry = models[0]
        kind = {"vllm": "vllm", "llamacpp": "llamacpp"}.get(entry.get("owned_by"), "openai")
        window = entry.get("max_model_len")
        if window is None and kind == "llamacpp":
            props = self.get_json("/props")
            window = (props.get("default_generation_settings") or {}).get("n_ctx")
        return ServerInfo(kind, entry["id"], int(window) if window else None)

    def close(self) -> None:
        with self._lock:
            clients, self._clients = self._clients, {}
        for kind, client in clients.items():
            if kind == "sync":
                client.close()


def sampling_body(params: dict) -> dict:
    """Our sampling parameters as request fields (top_k, not in OpenAI's API, goes in extra_body)."""
    unknown = sorted(set(params) - set(SAMPLING))
    if unknown:
        raise InputError(f"unknown sampling parameters {unknown}; accepted: {', '.join(SAMPLING)}")
    body: dict = {"stream": True, "stream_options": {"include_usage": True}}
    if params.get("max_new_tokens") is not None:
        body["max_tokens"] = params["max_new_tokens"]
    for name in ("temperature", "top_p", "seed"):
        if params.get(name) is not None:
            body[name] = params[name]
    if params.get("stop"):
        body["stop"] = list(params["stop"])
    extra = {"top_k": params.get("top_k") or 0}       # 0: no top-k cut (vLLM and llama-server alike)
    body["extra_body"] = extra
    return body


def chat_body(model: str, messages: list[dict], params: dict, *, tools: list[dict] | None = None,
              tool_choice=None, response_format: dict | None = None, template_kwargs: dict | None = None) -> dict:
    """The `chat.completions.create` arguments of one streamed request."""
    body = {"model": model, "messages": messages, **sampling_body(params)}
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
    return {"model": model, "prompt": prompt, **sampling_body(params)}


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


def is_replica_failure(err: BaseException) -> bool:
    """True for a server that cannot answer now (unreachable, timed out, 5xx, overloaded)."""
    openai = _openai()
    if isinstance(err, openai.APIConnectionError):
        return True
    return isinstance(err, openai.APIStatusError) and err.status_code in _FAILOVER_STATUS
