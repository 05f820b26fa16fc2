"""One OpenAI-compatible server on the wire, through the maintained `openai` client.

`Replica` holds a server's URLs, its timeouts and its lazily built sync and async `openai`
clients (retries off: failing over to another replica is the engine's job; one async client per
event loop). It also reads the server's non-OpenAI endpoints (/metrics, /tokenize, /props)
through the same clients, inside the same timeouts (wire.py builds the request bodies);
`is_replica_failure` tells a server that is down or broken
(try another) from a request that is wrong (raise); `describe_failure` says what happened.
"""
from __future__ import annotations

import asyncio
import json
import sys
import threading
from dataclasses import dataclass

from kvboost_engine import InputError

from .errors import BadReplyError
from .telemetry import PrefixCounters, parse_metrics, prefix_counters

SERVER_KINDS = ("vllm", "llamacpp", "kvboost")     # /v1/models owned_by values we know; others are "openai"
_FAILOVER_STATUS = (408, 429, 500, 502, 503, 504)
CONNECT_TIMEOUT_S = 5.0     # to open a connection
READ_TIMEOUT_S = 30.0       # for the response to start, and between two chunks of a stream
CLOSE_WAIT_S = 5.0          # the most close() waits for an idle loop's async client to close


def _openai():
    try:
        import openai
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError('the remote backend needs the openai client: pip install "kvboost-integrations[remote]"') from err
    return openai


@dataclass
class ServerInfo:
    """What a server says about itself: kind ("vllm", "llamacpp", "kvboost": our own server, or
    "openai": any other), model, window."""

    @property
    def takes_documents(self) -> bool:
        """Whether the server caches `{"type": "document"}` content parts as documents (ours does;
        the others get documents as text)."""
        return self.kind == "kvboost"

    kind: str
    model: str
    context_window: int | None


class Replica:
    """An OpenAI-compatible endpoint: `url` is its /v1 base, `root` the server root.

    connect_timeout_s: seconds to open a connection; read_timeout_s: seconds for a response to
    start and between two chunks of a stream (also for /metrics, /v1/models, /tokenize);
    timeout (the classes' overall `timeout`), when given, caps both."""

    def __init__(self, endpoint: str, *, api_key: str | None = None, timeout: float | None = None,
                 max_retries: int = 0, connect_timeout_s: float = CONNECT_TIMEOUT_S,
                 read_timeout_s: float = READ_TIMEOUT_S):
        if not isinstance(endpoint, str) or not endpoint.startswith(("http://", "https://")):
            raise InputError(f"an endpoint must be an http(s) URL such as http://127.0.0.1:8000/v1, got {endpoint!r}")
        for name, value in (("connect_timeout_s", connect_timeout_s), ("read_timeout_s", read_timeout_s),
                            ("timeout", timeout)):
            if value is not None and not value > 0:
                raise InputError(f"{name} must be a positive number of seconds, got {value!r}")
        base = endpoint.rstrip("/")
        self.root = base[:-3] if base.endswith("/v1") else base
        self.url = self.root + "/v1"
        self.api_key = api_key or "none"
        self.connect_timeout_s = min(connect_timeout_s, timeout or connect_timeout_s)
        self.read_timeout_s = min(read_timeout_s, timeout or read_timeout_s)
        self.max_retries = max_retries
        self.reports_cached_tokens: bool | None = None   # learned from the first usage seen
        self._sync = None
        self._async: dict[asyncio.AbstractEventLoop, object] = {}
        self._lock = threading.Lock()
        self.closes = 0             # close() calls so far: a request that sees it change was cut by one
        self.cutoffs: set = set()   # sync requests reading a stream from this replica now (close() cuts them)

    def __repr__(self) -> str:
        return f"Replica({self.url!r})"

    @property
    def client(self):
        """The sync `openai.OpenAI` client of this replica."""
        with self._lock:
            if self._sync is None:
                self._sync = self._make(_openai().OpenAI)
            return self._sync

    @property
    def aclient(self):
        """The `openai.AsyncOpenAI` client of this replica for the running event loop."""
        loop = asyncio.get_running_loop()
        with self._lock:
            for old in [old for old in self._async if old.is_closed()]:
                del self._async[old]        # its loop is gone: nothing can close it any more
            if loop not in self._async:
                self._async[loop] = self._make(_openai().AsyncOpenAI)
            return self._async[loop]

    def _make(self, cls):
        openai = _openai()
        timeout = openai.Timeout(self.read_timeout_s, connect=self.connect_timeout_s)
        # async: openai's default HTTP client closes itself when collected by a task on whatever loop runs
        # then, logged as an error once its own loop is gone (an asyncio.run per request); this one does not
        extra = {"http_client": openai.DefaultAsyncHttpxClient(timeout=timeout)} if cls is openai.AsyncOpenAI else {}
        return cls(base_url=self.url, api_key=self.api_key, max_retries=self.max_retries, timeout=timeout, **extra)

    def get_json(self, path: str) -> dict:
        return _json_object(self.client.get(self.root + path, cast_to=object), self.url, path)

    def post_json(self, path: str, body: dict) -> dict:
        return _json_object(self.client.post(self.root + path, body=body, cast_to=object), self.url, path)

    def prefix_counters(self, *, strict: bool = False) -> PrefixCounters | None:
        """The server's prefix-cache counters now (None if /metrics is off or has none we know).
        `strict`: a replica that cannot be reached or times out raises (it is failing) instead."""
        openai = _openai()
        try:
            text = self.client.get(self.root + "/metrics", cast_to=str)
        except openai.APIConnectionError:
            if strict:
                raise
            return None
        except openai.APIError:
            return None
        return prefix_counters(parse_metrics(text)) if isinstance(text, str) else None

    def info(self) -> ServerInfo:
        """Kind, first served model and context window, from /v1/models (and /props for llama.cpp).
        The kind is the model entry's `owned_by`: "vllm", "llamacpp", "kvboost" (our server)."""
        models = self.get_json("/v1/models").get("data") or []
        if not models:
            raise InputError(f"{self.url} serves no model")
        entry = models[0]
        kind = entry.get("owned_by") if entry.get("owned_by") in SERVER_KINDS else "openai"
        window = entry.get("max_model_len")
        if window is None and kind == "llamacpp":
            props = self.get_json("/props")
            window = (props.get("default_generation_settings") or {}).get("n_ctx")
        return ServerInfo(kind, entry["id"], int(window) if window else None)

    def close(self) -> None:
        """Close the sync client and the async ones (on their own event loops; see `aclose`)."""
        with self._lock:
            sync, self._sync = self._sync, None
            clients, self._async = self._async, {}
            self.closes += 1
        for cutoff in list(self.cutoffs):   # a read blocked in another thread wakes now, not at its timeout
            cutoff.cut("closed")
        if sync is not None:
            sync.close()
        for loop, client in clients.items():
            _close_on(loop, client)

    async def aclose(self) -> None:
        """`close`, awaiting the async client of the running loop."""
        loop = asyncio.get_running_loop()
        with self._lock:
            mine = self._async.pop(loop, None)
        self.close()
        if mine is not None:
            await mine.close()


def _close_on(loop: asyncio.AbstractEventLoop, client) -> None:
    """Close an AsyncOpenAI client on the loop it was used on, however that loop stands now."""
    if loop.is_closed():
        return                      # its connections went with the loop
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        _PENDING_CLOSES.add(task := loop.create_task(client.close()))
        task.add_done_callback(_PENDING_CLOSES.discard)
    elif loop.is_running():
        asyncio.run_coroutine_threadsafe(client.close(), loop)
    elif running is None:
        loop.run_until_complete(client.close())
    else:
        # another loop runs in this thread, and one thread cannot run two: close it on a thread of its own
        closer = threading.Thread(target=loop.run_until_complete, args=(client.close(),), name="kvboost-close")
        closer.start()
        closer.join(CLOSE_WAIT_S)


_PENDING_CLOSES: set = set()        # close tasks scheduled from sync code on a running loop (kept alive)


def _json_object(payload, url: str, path: str) -> dict:
    """A server's JSON answer, or BadReplyError when it is something else (an HTML error page)."""
    if isinstance(payload, str):
        try:
            payload = json.loads(payload)
        except json.JSONDecodeError:
            pass
    if not isinstance(payload, dict):
        raise BadReplyError(f"{url}: {path} answered with a body that is not a JSON object: {str(payload)[:80]!r}",
                            replica=url)
    return payload


def is_replica_failure(err: BaseException) -> bool:
    """True for a server that cannot answer now or answers brokenly (unreachable, timed out, 5xx,
    overloaded, a dropped stream, a malformed chunk, a body that is not JSON): try another replica."""
    openai = _openai()
    if isinstance(err, (BadReplyError, json.JSONDecodeError, openai.APIConnectionError)):
        return True
    if isinstance(err, openai.APIStatusError):
        return err.status_code in _FAILOVER_STATUS
    return isinstance(err, openai.APIError) or _is_transport_error(err)


def _is_transport_error(err: BaseException) -> bool:
    """An httpx transport error that an older openai client lets through unwrapped."""
    for name in ("httpx", "httpx2"):
        module = sys.modules.get(name)
        if module is not None and isinstance(err, getattr(module, "TransportError", ())):
            return True
    return False


def describe_failure(err: BaseException, replica: Replica) -> str:
    """What happened at a replica, in words (the timeouts named by their option)."""
    openai = _openai()
    cause = err.__cause__
    if isinstance(err, openai.APITimeoutError):
        if type(cause).__name__ == "ConnectTimeout":
            return f"no connection within connect_timeout_s={replica.connect_timeout_s:g} s"
        return f"no data for read_timeout_s={replica.read_timeout_s:g} s"
    if isinstance(err, openai.APIConnectionError):
        return f"connection failed ({type(cause).__name__}: {cause})" if cause else f"connection failed ({err})"
    if isinstance(err, json.JSONDecodeError):
        return f"a malformed stream chunk (not JSON: {err})"
    if isinstance(err, openai.APIStatusError):
        return f"HTTP {err.status_code}: {err.message}"
    return f"{type(err).__name__}: {err}"
