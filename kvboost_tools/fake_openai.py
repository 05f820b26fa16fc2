"""A small OpenAI-compatible server in a thread, on 127.0.0.1, for tests and benchmarks that need
no real model; it can also play a broken replica (`fault`, see `kvboost_tools.fake_faults`).

It speaks what the remote backend uses: /v1/models, /v1/chat/completions and /v1/completions
(streamed as server-sent events in a chunked HTTP/1.1 body, usage chunk included), /tokenize
(vLLM's fields), /metrics (vLLM's prefix-cache counters). Tokens are words, punctuation and
spaces; its prefix cache is token-exact: a prompt's cached tokens are its longest common prefix
with any earlier prompt. The reply is `reply` (or a tool call when tools are forced), cut by
`stop` and `max_tokens`. `requests` records every request body.

    with FakeServer() as good, FakeServer(fault=Fault("hang")) as bad:
        llm = ChatKVBoost(endpoint=[bad.url, good.url], engine_kwargs={"read_timeout_s": 1})
        bad.fault = Chaos({"hang": 0.05, "drop": 0.05}, seed=1)      # switch at any time
"""
from __future__ import annotations

import json
import re
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .fake_faults import Chaos, Fault

_TOKEN = re.compile(r"\w+|[^\w\s]|\s+")
HANG_LIMIT_S = 600.0        # a hanging request ends by itself after this (or when the server stops)


def tokens(text: str) -> list[str]:
    return _TOKEN.findall(text)


def render(messages: list[dict]) -> str:
    """The fake chat template."""
    parts = [f"<|{m['role']}|>{m.get('content') or ''}<|end|>" for m in messages]
    return "".join(parts) + "<|assistant|>"


class FakeServer:
    """`with FakeServer() as server: server.url` ("http://127.0.0.1:PORT/v1").

    fault: None (healthy), a `Fault` or a `Chaos`; an attribute, so a test or a soak can switch
    it while requests run. fail_with: an HTTP status every POST answers (the older spelling of
    `Fault("error", status=..., paths="*")`)."""

    def __init__(self, *, reply: str = "The answer is 42. Done.", kind: str = "vllm", report_cached: bool = True,
                 chunk_delay_s: float = 0.0, model: str = "fake-model", context_window: int = 4096,
                 fault: Fault | Chaos | None = None):
        self.reply = reply
        self.kind = kind
        self.report_cached = report_cached
        self.chunk_delay_s = chunk_delay_s
        self.model = model
        self.context_window = context_window
        self.fault = fault
        self.fail_with: int | None = None
        self.requests: list[dict] = []
        self.prompts: list[list[str]] = []
        self.queries = 0
        self.hits = 0
        self.lock = threading.Lock()
        self.released = threading.Event()       # set on stop: hanging requests end
        self._httpd = _QuietServer(("127.0.0.1", 0), _handler(self))
        self._httpd.daemon_threads = True
        self._httpd.block_on_close = False
        self.port = self._httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop listening: later connections are refused; hanging requests end."""
        self.released.set()
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> "FakeServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def completions(self) -> int:
        """How many completion requests reached this server."""
        with self.lock:
            return sum(1 for r in self.requests if r["path"] in ("/v1/chat/completions", "/v1/completions"))

    def fault_for(self, path: str) -> Fault | None:
        if self.fail_with is not None and path != "/metrics" and not path.startswith("/v1/models"):
            return Fault("error", status=self.fail_with, paths="*")
        fault = self.fault
        return fault.pick(path) if fault is not None else None

    def cache(self, prompt: str) -> tuple[int, int]:
        """(prompt tokens, cached tokens) for a prompt; remembers it."""
        toks = tokens(prompt)
        with self.lock:
            cached = max((_common(toks, old) for old in self.prompts), default=0)
            cached = min(cached, len(toks) - 1) if toks else 0
            self.prompts.append(toks)
            self.queries += len(toks)
            self.hits += cached
        return len(toks), cached

    def answer(self, body: dict) -> tuple[list[str], str]:
        """Reply pieces (words) and finish reason for a request's stop and max_tokens."""
        text, finish = self.reply, "stop"
        for stop in body.get("stop") or []:
            if stop in text:
                text = text[:text.index(stop)]
        pieces = tokens(text)
        limit = body.get("max_tokens")
        if limit is not None and len(pieces) > limit:
            pieces, finish = pieces[:limit], "length"
        return pieces, finish


class _QuietServer(ThreadingHTTPServer):
    """Connections that clients reset (after a timeout, or kept alive at exit) are not errors here."""

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)


def _common(a: list[str], b: list[str]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _handler(server: FakeServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"       # streams go out chunked: a dropped one is an incomplete body

        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            fault = server.fault_for(self.path)
            if fault is not None and _early(fault, self.path):
                self._fail_early(fault)
            elif self.path == "/v1/models":
                entry = {"id": server.model, "object": "model", "owned_by": server.kind}
                if server.kind == "vllm":
                    entry["max_model_len"] = server.context_window
                self._json({"object": "list", "data": [entry]})
            elif self.path == "/metrics":
                text = (f"# TYPE vllm:prefix_cache_queries_total counter\n"
                        f'vllm:prefix_cache_queries_total{{model_name="{server.model}"}} {server.queries}.0\n'
                        f'vllm:prefix_cache_hits_total{{model_name="{server.model}"}} {server.hits}.0\n')
                self._send(200, text.encode(), "text/plain; version=0.0.4")
            elif self.path == "/health":
                self._send(200, b"", "text/plain")
            else:
                self._send(404, b"not found", "text/plain")

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            with server.lock:
                server.requests.append({"path": self.path, **body})
            fault = server.fault_for(self.path)
            if fault is not None and _early(fault, self.path):
                self._fail_early(fault)
            elif self.path == "/tokenize":
                if "messages" in body:
                    self._json({"count": len(tokens(render(body["messages"])))})
                else:
                    self._json({"tokens": list(range(len(tokens(body["prompt"]))))})
            elif self.path in ("/v1/chat/completions", "/v1/completions"):
                self._complete(body, self.path == "/v1/chat/completions", fault)
            else:
                self._send(404, b"not found", "text/plain")

        def _fail_early(self, fault: Fault) -> None:
            """A fault before any response: no answer, a closed connection, HTML, or an error status."""
            if fault.mode == "hang":
                server.released.wait(HANG_LIMIT_S)
                self._drop()
            elif fault.mode == "drop":
                self._drop()
            elif fault.mode == "non_json":
                self._send(200, b"<html><body>502 Bad Gateway</body></html>", "text/html")
            else:
                self._json({"error": {"message": "failing on purpose"}}, fault.status)

        def _drop(self) -> None:
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

        def _complete(self, body: dict, chat: bool, fault: Fault | None) -> None:
            if body.get("model") != server.model:
                self._json({"error": {"message": f"model {body.get('model')!r} not found"}}, 404)
                return
            prompt = render(body["messages"]) if chat else body["prompt"]
            prompt_tokens, cached = server.cache(prompt)
            forced = chat and body.get("tools") and body.get("tool_choice") not in (None, "auto", "none")
            if chat and body.get("response_format", {}).get("type") in ("json_schema", "json_object"):
                pieces, finish = _json_pieces(body["response_format"]), "stop"
            else:
                pieces, finish = ([], "tool_calls") if forced else server.answer(body)
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(pieces) + (3 if forced else 0),
                     "total_tokens": prompt_tokens + len(pieces)}
            if server.report_cached:
                usage["prompt_tokens_details"] = {"cached_tokens": cached}
            chunks = _tool_chunks(body) if forced else [_delta(p, chat) for p in pieces]
            fault_at = None if fault is None else fault.after_chunks
            if fault is not None and fault.mode == "no_finish" and not fault.after_chunks:
                fault_at = len(chunks)          # all the text, then an end without a finish_reason
            chunks.append(_finish(finish, chat))
            if body.get("stream_options", {}).get("include_usage"):
                chunks.append({"choices": [], "usage": usage})
            self._stream(chunks, "chat.completion.chunk" if chat else "text_completion", fault, fault_at)

        def _stream(self, chunks: list[dict], kind: str, fault: Fault | None, fault_at: int | None) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            delay = fault.delay_s if fault is not None and fault.mode == "slow" else server.chunk_delay_s
            try:
                for index, chunk in enumerate(chunks):
                    if index == fault_at and self._fault_mid_stream(fault):
                        return
                    data = {"id": "fake-1", "object": kind, "created": 0, "model": server.model, **chunk}
                    self._chunk(f"data: {json.dumps(data)}\n\n".encode())
                    time.sleep(delay)
                self._chunk(b"data: [DONE]\n\n")
                self._chunk(b"")
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True

        def _fault_mid_stream(self, fault: Fault) -> bool:
            """Play `fault` here (after `after_chunks` chunks); True if the response ends with it."""
            if fault.mode == "hang":
                server.released.wait(HANG_LIMIT_S)
            if fault.mode == "keepalive":
                while not server.released.wait(fault.delay_s):
                    self._chunk(b": keep-alive\n\n")
            if fault.mode in ("hang", "drop", "keepalive"):
                self._drop()
                return True
            if fault.mode == "malformed":
                self._chunk(b'data: {"id": "fake-1", "choices": [{"index": 0, "delta": {"content": "x\n\n')
            if fault.mode in ("malformed", "no_finish"):
                self._chunk(b"data: [DONE]\n\n")
                self._chunk(b"")
                return True
            return False

        def _chunk(self, payload: bytes) -> None:
            self.wfile.write(f"{len(payload):x}\r\n".encode() + payload + b"\r\n")
            self.wfile.flush()

        def _json(self, data: dict, status: int = 200) -> None:
            self._send(status, json.dumps(data).encode(), "application/json")

        def _send(self, status: int, payload: bytes, kind: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

    return Handler


def _early(fault: Fault, path: str) -> bool:
    """Whether `fault` strikes before any response (otherwise it plays inside the stream)."""
    if fault.mode in ("non_json", "error"):
        return True
    streamed = path in ("/v1/chat/completions", "/v1/completions")
    return fault.mode in ("hang", "drop") and (fault.after_chunks == 0 or not streamed)


def _delta(text: str, chat: bool) -> dict:
    if chat:
        return {"choices": [{"index": 0, "delta": {"role": "assistant", "content": text}, "finish_reason": None}]}
    return {"choices": [{"index": 0, "text": text, "finish_reason": None}]}


def _finish(reason: str, chat: bool) -> dict:
    if chat:
        return {"choices": [{"index": 0, "delta": {}, "finish_reason": reason}]}
    return {"choices": [{"index": 0, "text": "", "finish_reason": reason}]}


def _json_pieces(response_format: dict) -> list[str]:
    """A JSON object for a response_format: the schema's properties filled with sample values."""
    schema = (response_format.get("json_schema") or {}).get("schema") or {}
    samples = {"string": "Paris", "integer": 42, "number": 4.2, "boolean": True}
    value = {name: samples.get(spec.get("type"), None) for name, spec in (schema.get("properties") or {}).items()}
    text = json.dumps(value)
    return [text[i:i + 8] for i in range(0, len(text), 8)]


def _tool_chunks(body: dict) -> list[dict]:
    """A streamed call of the forced tool (or the first one), its arguments in two pieces."""
    choice = body.get("tool_choice")
    name = choice["function"]["name"] if isinstance(choice, dict) else body["tools"][0]["function"]["name"]
    first = {"index": 0, "id": "call_fake", "type": "function", "function": {"name": name, "arguments": '{"city": '}}
    second = {"index": 0, "function": {"arguments": '"Paris"}'}}
    return [{"choices": [{"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": None}]}
            for call in (first, second)]
