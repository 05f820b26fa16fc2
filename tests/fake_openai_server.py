"""A small OpenAI-compatible server in a thread, for tests that need no real model.

It speaks what the remote backend uses: /v1/models, /v1/chat/completions and /v1/completions
(streamed as server-sent events, usage chunk included), /tokenize (vLLM's fields), /metrics
(vLLM's prefix-cache counters). Tokens are words, punctuation and spaces; its prefix cache is
token-exact: a prompt's cached tokens are its longest common prefix with any earlier prompt.
The reply is `reply` (or a tool call when tools are forced), cut by `stop` and `max_tokens`.
`requests` records every request body; `fail_with` makes it answer that HTTP status.
"""
from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_TOKEN = re.compile(r"\w+|[^\w\s]|\s+")


def tokens(text: str) -> list[str]:
    return _TOKEN.findall(text)


def render(messages: list[dict]) -> str:
    """The fake chat template."""
    parts = [f"<|{m['role']}|>{m.get('content') or ''}<|end|>" for m in messages]
    return "".join(parts) + "<|assistant|>"


class FakeServer:
    """`with FakeServer() as server: server.url` ("http://127.0.0.1:PORT/v1")."""

    def __init__(self, *, reply: str = "The answer is 42. Done.", kind: str = "vllm", report_cached: bool = True,
                 chunk_delay_s: float = 0.0, model: str = "fake-model", context_window: int = 4096):
        self.reply = reply
        self.kind = kind
        self.report_cached = report_cached
        self.chunk_delay_s = chunk_delay_s
        self.model = model
        self.context_window = context_window
        self.fail_with: int | None = None
        self.requests: list[dict] = []
        self.prompts: list[list[str]] = []
        self.queries = 0
        self.hits = 0
        self.lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop listening: later connections are refused."""
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> "FakeServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

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


def _common(a: list[str], b: list[str]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _handler(server: FakeServer):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            if self.path == "/v1/models":
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
            if server.fail_with is not None:
                self._json({"error": {"message": "failing on purpose"}}, server.fail_with)
            elif self.path == "/tokenize":
                if "messages" in body:
                    self._json({"count": len(tokens(render(body["messages"])))})
                else:
                    self._json({"tokens": list(range(len(tokens(body["prompt"]))))})
            elif self.path in ("/v1/chat/completions", "/v1/completions"):
                self._complete(body, chat=self.path == "/v1/chat/completions")
            else:
                self._send(404, b"not found", "text/plain")

        def _complete(self, body: dict, chat: bool) -> None:
            if body.get("model") != server.model:
                self._json({"error": {"message": f"model {body.get('model')!r} not found"}}, 404)
                return
            prompt = render(body["messages"]) if chat else body["prompt"]
            prompt_tokens, cached = server.cache(prompt)
            forced = chat and body.get("tools") and body.get("tool_choice") not in (None, "auto", "none")
            pieces, finish = ([], "tool_calls") if forced else server.answer(body)
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(pieces) + (3 if forced else 0),
                     "total_tokens": prompt_tokens + len(pieces)}
            if server.report_cached:
                usage["prompt_tokens_details"] = {"cached_tokens": cached}
            chunks = _tool_chunks(body) if forced else [_delta(p, chat) for p in pieces]
            chunks.append(_finish(finish, chat))
            if body.get("stream_options", {}).get("include_usage"):
                chunks.append({"choices": [], "usage": usage})
            self._stream(chunks, "chat.completion.chunk" if chat else "text_completion")

        def _stream(self, chunks: list[dict], kind: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            try:
                for chunk in chunks:
                    data = {"id": "fake-1", "object": kind, "created": 0, "model": server.model, **chunk}
                    self.wfile.write(f"data: {json.dumps(data)}\n\n".encode())
                    self.wfile.flush()
                    time.sleep(server.chunk_delay_s)
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                pass

        def _json(self, data: dict, status: int = 200) -> None:
            self._send(status, json.dumps(data).encode(), "application/json")

        def _send(self, status: int, payload: bytes, kind: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

    return Handler


def _delta(text: str, chat: bool) -> dict:
    if chat:
        return {"choices": [{"index": 0, "delta": {"role": "assistant", "content": text}, "finish_reason": None}]}
    return {"choices": [{"index": 0, "text": text, "finish_reason": None}]}


def _finish(reason: str, chat: bool) -> dict:
    if chat:
        return {"choices": [{"index": 0, "delta": {}, "finish_reason": reason}]}
    return {"choices": [{"index": 0, "text": "", "finish_reason": reason}]}


def _tool_chunks(body: dict) -> list[dict]:
    """A streamed call of the forced tool (or the first one), its arguments in two pieces."""
    choice = body.get("tool_choice")
    name = choice["function"]["name"] if isinstance(choice, dict) else body["tools"][0]["function"]["name"]
    first = {"index": 0, "id": "call_fake", "type": "function", "function": {"name": name, "arguments": '{"city": '}}
    second = {"index": 0, "function": {"arguments": '"Paris"}'}}
    return [{"choices": [{"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": None}]}
            for call in (first, second)]
