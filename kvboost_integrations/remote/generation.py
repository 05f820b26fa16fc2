"""A remote request's result (`RemoteGeneration`) and the state that streamed chunks build up.

`RemoteGeneration` is a `Generation` (so every framework class reads it as it reads the local
engine's): `reused_tokens` are the prompt tokens the server's prefix cache served (exact-prefix
reuse, so they count as `reused_exact`; our own server splits them into `cached_exact_tokens` and
`cached_moved_tokens`, which become `reused_exact` and `reused_moved`), `ttft_s` is measured here from the call to the first
delta. It adds what only a remote call has: the replica that answered, the replicas that failed
before it, the tool calls the server parsed, the server's own figures (`server`), and the
sentences the layout moved (`volatile_moved`, only with the opt-in `volatile="last"`).

`ReplyState` takes the stream's chunks; a reply is complete only once a chunk carries its
`finish_reason` (`check_complete`), and a chunk that is not a chat/completion chunk is a
`BadReplyError`: neither ever becomes a shorter answer.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from kvboost_engine import Generation, TextDelta

from .errors import BadReplyError


@dataclass(slots=True)
class RemoteGeneration(Generation):
    """Result of one remote request. `server`: cached_tokens and where they came from
    ("usage" or the replica's "metrics"), and llama.cpp's `timings` when it sends them."""

    completion_count: int = 0
    replica: str = ""
    served_model: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    failovers: list[str] = field(default_factory=list)
    server: dict = field(default_factory=dict)
    volatile_moved: list[str] | None = None

    @property
    def completion_tokens(self) -> int:
        return self.completion_count

    def telemetry(self) -> dict:
        data = Generation.telemetry(self)
        data.update(model_name=self.served_model, replica=self.replica, served_model=self.served_model, failovers=list(self.failovers),
                    server_cached_tokens=self.server.get("cached_tokens"),
                    server_cache_source=self.server.get("source"))
        if "timings" in self.server:
            data["server_timings"] = self.server["timings"]
        if self.volatile_moved is not None:
            data["volatile_moved"] = list(self.volatile_moved)
        return data


class ReplyState:
    """Text, tool calls, finish reason and usage gathered from a stream of chunks."""

    def __init__(self, started: float):
        self.started = started
        self.first_token_at: float | None = None
        self.parts: list[str] = []
        self.calls: dict[int, dict] = {}
        self.finish_reason: str | None = None
        self.usage = None
        self.timings: dict | None = None
        self.logprobs: list[dict] | None = None     # when the server sends them
        self._unsent: list[dict] = []                 # logprobs not yet carried by a delta
        self._thinking = False                        # inside reasoning the server sends apart

    @property
    def delivered(self) -> bool:
        """Whether text of this reply has been handed on (it can no longer move to another replica)."""
        return bool(self.parts)

    @property
    def received_chars(self) -> int:
        return sum(len(part) for part in self.parts)

    def feed(self, kind: str, chunk) -> str:
        """Take one chunk of a "chat" or "completion" stream; return its text delta ("" if none)."""
        if not isinstance(getattr(chunk, "choices", None), list):
            raise BadReplyError(f"a stream chunk without a choices list: {str(chunk)[:120]!r}")
        try:
            return self.feed_chat(chunk) if kind == "chat" else self.feed_completion(chunk)
        except (AttributeError, TypeError) as err:    # a choice, delta or tool call of the wrong shape
            raise BadReplyError(f"a malformed stream chunk ({type(err).__name__}: {err}): {str(chunk)[:120]!r}") from err

    def check_complete(self) -> None:
        """BadReplyError unless a chunk carried the reply's finish_reason (the server said it is done)."""
        if self.finish_reason is None:
            raise BadReplyError(f"the stream ended without a finish_reason after {self.received_chars} characters "
                                "(an incomplete reply)")

    def feed_chat(self, chunk) -> str:
        """Take one chat.completion.chunk; return its text delta ("" if none)."""
        self._common(chunk)
        text = ""
        for choice in chunk.choices[:1]:
            delta = choice.delta
            text = self._thinking_text(delta)
            if delta is not None and delta.content:
                text += self._end_thinking() + delta.content
            for call in (delta.tool_calls or []) if delta is not None else []:
                self._feed_call(call)
            if choice.finish_reason:
                self.finish_reason = choice.finish_reason
            self._take_logprobs(chat_logprobs(getattr(choice, "logprobs", None)))
        return self._text(text)

    def feed_completion(self, chunk) -> str:
        """Take one text_completion chunk; return its text delta."""
        self._common(chunk)
        text = ""
        for choice in chunk.choices[:1]:
            text = choice.text or ""
            if choice.finish_reason:
                self.finish_reason = choice.finish_reason
            self._take_logprobs(completion_logprobs(getattr(choice, "logprobs", None)))
        return self._text(text)

    def _thinking_text(self, delta) -> str:
        """A server's separate reasoning field (vLLM's reasoning parser: `reasoning_content` or
        `reasoning`; llama-server's `reasoning_content`) as the text the model wrote, Qwen3's
        `<think>` block, so the framework classes treat it as they treat a local model's."""
        extra = (getattr(delta, "model_extra", None) or {}) if delta is not None else {}
        reasoning = extra.get("reasoning_content") or extra.get("reasoning")
        if not isinstance(reasoning, str) or not reasoning:
            return ""
        opening = "" if self._thinking else "<think>\n"
        self._thinking = True
        return opening + reasoning

    def _end_thinking(self) -> str:
        closing = "\n</think>\n\n" if self._thinking else ""
        self._thinking = False
        return closing

    def _take_logprobs(self, entries: list[dict]) -> None:
        if entries:
            self.logprobs = (self.logprobs or []) + entries
            self._unsent += entries

    def _common(self, chunk) -> None:
        if getattr(chunk, "usage", None) is not None:
            self.usage = chunk.usage
        timings = (chunk.model_extra or {}).get("timings")
        if timings:
            self.timings = timings

    def _text(self, text: str) -> str:
        if text:
            self._first_token()
            if self._unsent:
                text, self._unsent = TextDelta(text, self._unsent), []
            self.parts.append(text)
        return text

    def _first_token(self) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()

    def _feed_call(self, call) -> None:
        self._first_token()
        entry = self.calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
        entry["id"] = call.id or entry["id"]
        if call.function is not None:
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""

    def cached_tokens(self) -> int | None:
        """Prompt tokens the server reports as served from its cache (None: it does not say)."""
        details = getattr(self.usage, "prompt_tokens_details", None) if self.usage is not None else None
        cached = getattr(details, "cached_tokens", None) if details is not None else None
        if cached is None and self.timings and "cache_n" in self.timings:
            cached = self.timings["cache_n"]
        return cached

    def _cached_moved(self) -> int:
        """Cached tokens reused at another position (our server's `cached_moved_tokens`; 0 elsewhere:
        other servers' prefix caches are exact only)."""
        details = getattr(self.usage, "prompt_tokens_details", None)
        return int(getattr(details, "cached_moved_tokens", None) or 0)

    def generation(self, *, replica: str, model: str, cancelled: bool, failovers: list[str],
                   metrics_cached: int | None = None) -> RemoteGeneration:
        now = time.perf_counter()
        cached = self.cached_tokens()
        source = "usage" if cached is not None else ("metrics" if metrics_cached is not None else None)
        cached = cached if cached is not None else metrics_cached
        prompt_tokens = getattr(self.usage, "prompt_tokens", 0) or 0
        server = {"cached_tokens": cached, "source": source}
        if self.timings:
            server["timings"] = self.timings
        finish = "cancelled" if cancelled else (self.finish_reason or "stop")
        reused = min(cached or 0, prompt_tokens)
        moved = min(self._cached_moved(), reused) if source == "usage" else 0
        return RemoteGeneration(
            text="".join(self.parts), finish_reason=finish, prompt_tokens=prompt_tokens, reused_tokens=reused,
            reused_exact=reused - moved, reused_moved=moved, ttft_s=(self.first_token_at or now) - self.started,
            total_s=now - self.started,
            completion_count=getattr(self.usage, "completion_tokens", 0) or 0, replica=replica, served_model=model,
            tool_calls=[_call(index, entry) for index, entry in sorted(self.calls.items())],
            failovers=list(failovers), server=server, logprobs=self.logprobs)


def chat_logprobs(logprobs) -> list[dict]:
    """A chat chunk's `logprobs.content` as our entries (OpenAI's chat format already)."""
    content = getattr(logprobs, "content", None) or []
    return [item.model_dump() if hasattr(item, "model_dump") else dict(item) for item in content]


def completion_logprobs(logprobs) -> list[dict]:
    """A completions chunk's legacy logprobs (tokens, token_logprobs, top_logprobs dicts) as chat entries."""
    if logprobs is None:
        return []
    tokens = getattr(logprobs, "tokens", None) or []
    values = getattr(logprobs, "token_logprobs", None) or []
    tops = getattr(logprobs, "top_logprobs", None) or [None] * len(tokens)
    return [{"token": token, "logprob": value, "bytes": list(token.encode()),
             "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in (top or {}).items()]}
            for token, value, top in zip(tokens, values, tops)]


def _call(index: int, entry: dict) -> dict:
    """A finished tool call: id, name, arguments (the JSON string sent) and args (parsed, or None)."""
    try:
        args = json.loads(entry["arguments"]) if entry["arguments"] else {}
    except json.JSONDecodeError:
        args = None
    return {"id": entry["id"] or f"call_{index}", "index": index, "name": entry["name"],
            "arguments": entry["arguments"], "args": args}
