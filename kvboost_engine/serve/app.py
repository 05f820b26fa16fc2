"""The ASGI application: one engine behind OpenAI's HTTP API (starlette).

Routes: POST /v1/chat/completions (tools included, see tools.py) and /v1/completions (JSON, or
server-sent events with `stream: true`), POST /tokenize (vLLM's shape, see tokenize.py), GET
/v1/models (`owned_by: "kvboost"`: how our remote client knows it talks to us), /health, /metrics. The engine's blocking
calls run off the event loop (the call that tokenizes and submits on a worker thread, the stream
read by a `Pump`).

Hygiene: an API key (Bearer) guards /v1/* and /tokenize when set (401); bodies over `max_body_bytes` get 413;
bad JSON or a bad field 400 naming it; a full engine queue 429 with Retry-After; a server that
drains (SIGTERM) answers 503 to requests on open connections while in-flight ones finish; a client
that disconnects cancels its request within 2 x POLL_S, streaming or not (the engine frees its blocks).
"""
from __future__ import annotations

import hmac
import json
import time
from dataclasses import dataclass, field
from functools import partial

try:
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import ClientDisconnect, Request
    from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Route
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError('the server needs starlette and uvicorn: pip install "kvboost-integrations[serve]"') from err

from ..engine import Engine
from ..errors import BudgetError, ContextWindowError, InputError, KVBoostError, QueueFullError
from .metrics import Metrics, kv_bytes
from .protocol import BadRequest, Call, engine_parameters, parse_chat, parse_completion
from .pump import CUT_MESSAGE, Inflight, Pump
from .replies import Reply, error_body, sse
from .tokenize import tokenize
from .tools import ToolReply, prepare_tools

MAX_BODY_BYTES = 8 * 2**20
RETRY_AFTER_S = 1


@dataclass
class ServerState:
    """What the routes share: the engine, its served name, options, counters, the drain flag."""

    engine: Engine
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    retry_after_s: int = RETRY_AFTER_S
    metrics: Metrics = field(default_factory=Metrics)
    draining: bool = False
    inflight: Inflight = field(default_factory=Inflight)    # the requests' pumps (pump.cut_off stops them all)
    accepted: frozenset = field(default_factory=engine_parameters)


def create_app(engine: Engine, *, model_name: str | None = None, api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, retry_after_s: int = RETRY_AFTER_S) -> Starlette:
    """The ASGI app serving `engine` under `model_name` (default: the engine's model name).
    `api_key`: when set, /v1/* and /tokenize need `Authorization: Bearer <api_key>`. `app.state.kvboost` is the
    ServerState (set `.draining = True` to refuse new requests while in-flight ones finish)."""
    if not isinstance(max_body_bytes, int) or max_body_bytes < 1:
        raise InputError(f"max_body_bytes must be an int >= 1, got {max_body_bytes!r}")
    if api_key is not None and (not isinstance(api_key, str) or not api_key):
        raise InputError("api_key must be a non-empty string or None")
    state = ServerState(engine, model_name or engine.model_name, api_key, max_body_bytes, retry_after_s)
    app = Starlette(routes=[
        Route("/v1/chat/completions", partial(_generate, kind="chat"), methods=["POST"]),
        Route("/v1/completions", partial(_generate, kind="completion"), methods=["POST"]),
        Route("/v1/models", _models, methods=["GET"]),
        Route("/v1/models/{model:path}", _models, methods=["GET"]),
        Route("/tokenize", _tokenize, methods=["POST"]),
        Route("/health", _health, methods=["GET"]),
        Route("/metrics", _metrics, methods=["GET"]),
    ], exception_handlers={404: _not_found, 405: _not_found})
    app.state.kvboost = state
    return app


# ---- routes ---------------------------------------------------------------------------------
async def _health(request: Request) -> Response:
    state: ServerState = request.app.state.kvboost
    if state.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    return JSONResponse({"status": "ok"})


async def _metrics(request: Request) -> Response:
    state: ServerState = request.app.state.kvboost
    text = state.metrics.render(kv_bytes(state.engine.memory()))
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


async def _models(request: Request) -> Response:
    state: ServerState = request.app.state.kvboost
    refused = _refuse(request, state)
    if refused is not None:
        return refused
    entry = {"id": state.model_name, "object": "model", "created": 0, "owned_by": "kvboost",
             "max_model_len": state.engine.context_window}
    asked = request.path_params.get("model")
    if asked is None:
        return JSONResponse({"object": "list", "data": [entry]})
    if asked != state.model_name:
        return error_response(BadRequest(f"model {asked!r} is not served here; this server serves "
                                         f"{state.model_name!r}", "model", status=404), state)
    return JSONResponse(entry)


async def _tokenize(request: Request) -> Response:
    state: ServerState = request.app.state.kvboost
    refused = _refuse(request, state)
    if refused is not None:
        return refused
    try:
        body = await _read_json(request, state.max_body_bytes)
        return JSONResponse(await run_in_threadpool(tokenize, state.engine, body))
    except Exception as err:  # noqa: BLE001 - mapped to a status
        return error_response(err, state)


async def _generate(request: Request, kind: str) -> Response:
    state: ServerState = request.app.state.kvboost
    response = await _answer(request, state, kind)
    state.metrics.answered(kind, response.status_code)
    return response


async def _answer(request: Request, state: ServerState, kind: str) -> Response:
    refused = _refuse(request, state)
    if refused is not None:
        return refused
    try:
        body = await _read_json(request, state.max_body_bytes)
        call, fmt, stream = await run_in_threadpool(_start, state, body, kind)      # parsing is work too
    except Exception as err:  # noqa: BLE001 - mapped to a status; unknown ones are a 500
        return error_response(err, state)
    state.metrics.started()
    pump = Pump(stream, time.perf_counter(), state.metrics.finished, state.inflight)     # counted however it ends
    try:
        event = await pump.next(request.is_disconnected)
    except BaseException:               # cancelled by uvicorn: the request stops too
        pump.cancel()
        raise
    state.metrics.first_event()
    if event[0] in ("error", "gone") or pump.cut_short:       # no reply: an error, a client gone, the drain's cut
        return _ended(event, pump, state)
    tools = ToolReply(fmt, call.one_call) if fmt is not None else None
    reply = Reply(kind, state.model_name, tools, usage_null=call.include_usage)
    if call.stream:                     # however the response ends: a client that left stops its request
        return _EventStream(_events(pump, event, reply, call), pump.cancel,
                            media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return await _collect(pump, event, reply, request, state)


def _start(state: ServerState, body, kind: str):
    """Parse, tokenize and submit (on a worker thread): the call, its tool format, its stream."""
    call = (parse_chat if kind == "chat" else parse_completion)(body, state.accepted)
    if call.model not in (None, state.model_name):
        raise BadRequest(f"model {call.model!r} is not served here; this server serves {state.model_name!r}",
                         "model", status=404)
    engine = state.engine
    fmt = prepare_tools(call, call.tools, call.tool_choice, engine.tokenizer) if kind == "chat" else None
    start = partial(engine.stream_chat, call.payload, template_kwargs=call.template_kwargs) if kind == "chat" \
        else partial(engine.stream, call.payload)
    try:
        return call, fmt, start(**call.params)
    except ContextWindowError as err:           # no max_tokens: as OpenAI, the reply stops where the window does
        prompt_tokens = getattr(err, "prompt_tokens", None)
        room = engine.context_window - (engine.context_window if prompt_tokens is None else prompt_tokens)
        if "max_new_tokens" in call.params or room < 1:
            raise _window_error(err, call, prompt_tokens, engine.context_window) from None
        return call, fmt, start(**{**call.params, "max_new_tokens": room})


def _window_error(err: ContextWindowError, call: Call, prompt_tokens: int | None, window: int) -> ContextWindowError:
    """The engine's context-window error in the client's terms: its budget field (`max_tokens` or
    `max_completion_tokens`, not the engine's `max_new_tokens`) named and set as `param`; without
    one, the prompt that leaves no room for a reply."""
    if prompt_tokens is None:
        return err
    if call.budget_field is not None and prompt_tokens < window:     # else no budget would fit: the prompt's fault
        asked = call.params["max_new_tokens"]
        error = ContextWindowError(f"prompt has {prompt_tokens} tokens and {call.budget_field} is {asked}: together "
                                   f"{prompt_tokens + asked}, beyond the model's context window of {window} tokens")
        error.param = call.budget_field
    else:
        error = ContextWindowError(f"prompt has {prompt_tokens} tokens: it fills the model's context window of "
                                   f"{window} tokens, leaving no room for a reply")
        error.param = "messages" if call.kind == "chat" else "prompt"
    error.prompt_tokens = prompt_tokens
    return error


async def _collect(pump: Pump, event: tuple, reply: Reply, request: Request, state: ServerState) -> Response:
    """The whole reply as one JSON body (the client leaving cancels the request)."""
    try:
        while event[0] == "delta":
            event = await pump.next(request.is_disconnected)
    except BaseException:               # the server's drain timed out (CancelledError): the request stops too
        pump.cancel()
        raise
    return _ended(event, pump, state) or JSONResponse(reply.complete(pump.generation))


def _ended(event: tuple, pump: Pump, state: ServerState) -> Response | None:
    """The response of a request that ended without its reply (None: it has one)."""
    if event[0] == "error":
        return error_response(event[1], state)
    if event[0] == "gone":
        return Response(status_code=499)
    return _error(503, CUT_MESSAGE, kind="server_error", headers={"Connection": "close"}) if pump.cut_short else None


async def _events(pump: Pump, event: tuple, reply: Reply, call: Call):
    """Server-sent events: the role chunk, one chunk per delta, the finish_reason chunk, the usage
    chunk if asked, [DONE]; an error after the first byte is an `error` event and no [DONE]."""
    try:
        first = reply.first_chunk()
        if first is not None:
            yield sse(first)
        while event[0] == "delta":
            for chunk in reply.delta_chunks(event[1]) if event[1] or getattr(event[1], "logprobs", None) else ():
                yield sse(chunk)
            event = await pump.next()
        if event[0] == "error" or pump.cut_short:
            yield sse(error_body(CUT_MESSAGE if pump.cut_short else str(event[1]) or type(event[1]).__name__,
                                 kind="server_error"))
            return
        for chunk in reply.end_chunks(pump.generation):
            yield sse(chunk)
        if call.include_usage:
            yield sse(reply.usage_chunk(pump.generation))
        yield sse("[DONE]")
    finally:
        pump.cancel()                   # a no-op after the end; a client that left stops its request


class _EventStream(StreamingResponse):
    """A streaming response that cancels its request however the response ends."""

    def __init__(self, content, on_close, **kwargs):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


# ---- checks and errors ----------------------------------------------------------------------
def _refuse(request: Request, state: ServerState) -> Response | None:
    """503 while draining, 401 without the API key; None when the request may go on."""
    if state.draining:
        return _error(503, "the server is shutting down; retry on another server", kind="server_error",
                      headers={"Connection": "close"})
    if state.api_key is None:
        return None
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), state.api_key.encode()):
        return _error(401, "a valid API key is needed: Authorization: Bearer <key>", kind="authentication_error",
                      code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    return None


async def _read_json(request: Request, limit: int):
    """The body as JSON; 413 past `limit` bytes (announced or counted), 400 if it is not JSON."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise BadRequest(f"the request body has {length} bytes, more than the server's limit of {limit}", status=413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BadRequest(f"the request body is over the server's limit of {limit} bytes", status=413)
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as err:
        raise BadRequest(f"the request body is not valid JSON: {err}") from None
    except RecursionError:
        raise BadRequest("the request body nests JSON deeper than the server reads") from None


def error_response(err: BaseException, state: ServerState) -> Response:
    """An exception as OpenAI's error body with its HTTP status (499: the client left mid-body)."""
    if isinstance(err, ClientDisconnect):
        return Response(status_code=499)
    if isinstance(err, BadRequest):
        return _error(err.status, str(err), param=err.param)
    if isinstance(err, QueueFullError):
        return _error(429, str(err), kind="rate_limit_error", code="queue_full",
                      headers={"Retry-After": str(state.retry_after_s)})
    if isinstance(err, ContextWindowError):
        return _error(400, str(err), code="context_length_exceeded", param=getattr(err, "param", None))
    if isinstance(err, InputError):
        return _error(400, str(err))
    if isinstance(err, BudgetError):        # cannot fit the KV pool even alone: retrying will not help
        return _error(400, str(err), code="kv_budget_exceeded")
    if isinstance(err, KVBoostError):
        return _error(503, str(err), kind="server_error")
    return _error(500, f"{type(err).__name__}: {err}", kind="server_error")


async def _not_found(request: Request, exc) -> Response:
    """An unknown route or method, in OpenAI's error shape (clients parse it) rather than plain text."""
    status = getattr(exc, "status_code", 404)
    what = "route" if status == 404 else "method"
    return _error(status, f"no {what} {request.method} {request.url.path} on this server", code=f"unknown_{what}",
                  headers=getattr(exc, "headers", None))         # 405: Allow


def _error(status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None,
           code: str | None = None, headers: dict | None = None) -> Response:
    return JSONResponse(error_body(message, kind=kind, param=param, code=code), status_code=status, headers=headers)
