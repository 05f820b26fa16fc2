"""`RemoteEngine`: the part of the Engine API the framework classes use, served by
OpenAI-compatible servers (vLLM, llama.cpp's llama-server, ...) instead of an embedded model.

A request is laid out for the servers' prefix caches (layout.py; our own server,
`kvboost_engine.serve`, known by its /v1/models `owned_by: "kvboost"`, gets document parts as
they are and counts tokens with /tokenize), routed to the replica most
likely to hold its prefix (routing.py), streamed through the `openai` client (client.py) and
returned as a `GenerationStream` of text deltas ending in a `RemoteGeneration` with usage,
the server's cached-token count, TTFT and the replica that answered (generation.py). A replica
that is down or failing before the first token reaches the caller is marked and the request goes
to the next one; if none answers, `ReplicaUnavailableError` names each replica's error; a failure
after it raises `ReplyInterruptedError` (dispatch.py). The prompt text is sent exactly as given
unless `volatile="last"` is asked for.
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from kvboost_engine import GenerationStream, InputError

from .client import CONNECT_TIMEOUT_S, READ_TIMEOUT_S, Replica, ServerInfo
from .wire import chat_body, completion_body
from .cutoff import CancelEvent
from .dispatch import Dispatcher
from .generation import RemoteGeneration
from .layout import VOLATILE_PATTERNS, LayoutOptions, PromptLayout, route_key_of_text
from .routing import Router
from .telemetry import CacheReport, format_report
from .tokens import ServerTokenizer, count_chat_local, encode_local

# Options of RemoteEngine beyond the endpoint, key and model (what `engine_kwargs` may hold).
REMOTE_OPTIONS = ("routing", "load_factor", "cooldown_s", "connect_timeout_s", "read_timeout_s", "document_order",
                  "volatile", "volatile_patterns", "blend_separator", "remembered_sequences", "tokenizer",
                  "context_window")
TEMPLATE_GLUE_TOKENS = 4    # tokens a chat template adds per message (ChatML: 5); positions are estimates


@dataclass
class RemotePrompt:
    """A laid-out prompt's segments as token counts: `chunk_ends` (cumulative) and `chunk_kinds`."""

    chunk_ends: list[int] = field(default_factory=list)
    chunk_kinds: list[str] = field(default_factory=list)


class RemoteEngine:
    """Chat and completion requests over one or more OpenAI-compatible endpoints.

    Example:
        ```python
        engine = RemoteEngine(["http://10.0.0.1:8000/v1", "http://10.0.0.2:8000/v1"])
        print(engine.chat([{"role": "user", "content": "Hi"}]).text)
        print(engine.format_cache_report())
        ```

    endpoints: one URL or a list (replicas serving the same model). served_model: the model
    name to request (None: the first one the server lists). routing: "cache" (consistent
    hashing of the leading segments, bounded loads) or "round_robin". connect_timeout_s (5) and
    read_timeout_s (30: for the response to start and between chunks; /metrics too): past them
    the replica counts as failed; `timeout` (the classes' overall one) caps both. document_order:
    "cache" (documents that follow a sequence sent before are put in its order) or "relevance"
    (as given). volatile: "keep" (default: the text as given) or "last" (opt-in: sentences with
    dates, times and ids leave system messages for the last user message, listed in the reply's
    `volatile_moved`). blend_separator: LMCache CacheBlend's separator, put around documents.
    tokenizer: an HF tokenizer or model directory for local token counts (None: the server's).
    """

    def __init__(self, endpoints: str | list[str], *, api_key: str | None = None, served_model: str | None = None,
                 timeout: float | None = None, max_retries: int = 0, routing: str = "cache",
                 load_factor: float = 1.25, cooldown_s: float = 10.0, connect_timeout_s: float = CONNECT_TIMEOUT_S,
                 read_timeout_s: float = READ_TIMEOUT_S, document_order: str = "cache",
                 volatile: str = "keep", volatile_patterns: tuple[str, ...] = VOLATILE_PATTERNS,
                 blend_separator: str | None = None, remembered_sequences: int = 4096, tokenizer=None,
                 context_window: int | None = None):
        endpoints = [endpoints] if isinstance(endpoints, str) else list(endpoints or [])
        replicas = [Replica(e, api_key=api_key, timeout=timeout, max_retries=max_retries,
                            connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s) for e in endpoints]
        self.replicas = {replica.url: replica for replica in replicas}
        self.router = Router([r.url for r in replicas], policy=routing, load_factor=load_factor,
                             cooldown_s=cooldown_s)
        self.layout = PromptLayout(LayoutOptions(document_order, volatile, tuple(volatile_patterns),
                                                 blend_separator, remembered_sequences))
        self.report = CacheReport(list(self.replicas))
        self.dispatch = Dispatcher(self.replicas, self.router, self.report, timeout)
        if context_window is not None and context_window <= 0:
            raise InputError(f"context_window must be positive, got {context_window}")
        self._served_model = served_model
        self._context_window = context_window
        self._tokenizer_option = tokenizer
        self._tokenizer = None
        self._info: ServerInfo | None = None
        self._lock = threading.Lock()

    # ---- what the server is ---------------------------------------------------------------
    def server_info(self) -> ServerInfo:
        """Kind, model and context window of the servers (asked once, from the first that answers)."""
        with self._lock:
            if self._info is None:
                self._info = self.dispatch.any_replica(lambda replica: replica.info())
            return self._info

    @property
    def model_name(self) -> str:
        return self._served_model or self.server_info().model

    @property
    def context_window(self) -> int:
        window = self._context_window or self.server_info().context_window
        if window is None:
            raise InputError("the server does not report its context window; pass context_window=")
        return window

    @property
    def tokenizer(self):
        """An HF-style tokenizer: `tokenizer(text)["input_ids"]` (local if given, else the server's)."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._make_tokenizer()
            return self._tokenizer

    def _make_tokenizer(self):
        option = self._tokenizer_option
        if option is None:
            info = self._info or self.dispatch.any_replica(lambda replica: replica.info())
            self._info = info
            post = lambda path, body: self.dispatch.any_replica(lambda replica: replica.post_json(path, body))  # noqa: E731
            return ServerTokenizer(post, info.kind, self._served_model or info.model)
        if isinstance(option, str):
            from transformers import AutoTokenizer
            return AutoTokenizer.from_pretrained(option)
        return option

    def count_tokens(self, text_or_messages, *, tools: list[dict] | None = None, **template_kwargs) -> int:
        """Tokens of a text, or prompt tokens of chat messages (the chat template included, with
        `tools`, OpenAI tool dicts, and `template_kwargs` such as enable_thinking, rendered by it)."""
        tokenizer = self.tokenizer
        if isinstance(text_or_messages, str):
            return len(tokenizer.encode(text_or_messages) if isinstance(tokenizer, ServerTokenizer)
                       else encode_local(tokenizer, text_or_messages))
        wire = self._sent_messages(self.layout.lay_out(list(text_or_messages), record=False))
        if isinstance(tokenizer, ServerTokenizer):
            return tokenizer.count_chat(wire, tools, template_kwargs)
        return count_chat_local(tokenizer, wire, tools, template_kwargs)

    def encode_messages(self, messages, **template_kwargs) -> RemotePrompt:
        """Token counts of the laid-out prompt's segments, for document-reuse telemetry.

        Segments are counted alone and the template's glue is estimated, so positions are close
        to, not exactly, the server's."""
        tokenizer = self.tokenizer
        prompt = RemotePrompt()
        total = 0
        for kind, text in self.layout.lay_out(list(messages), record=False).segments:
            total += len(tokenizer(text, add_special_tokens=False)["input_ids"]) + TEMPLATE_GLUE_TOKENS
            prompt.chunk_ends.append(total)
            prompt.chunk_kinds.append(kind)
        return prompt

    def order_documents(self, messages) -> tuple[list[dict], int]:
        """The messages as given and how many of their documents the layout will put first (those
        that continue a sequence sent before). The layout orders documents itself when it sends
        (`document_order`), so the framework classes' `document_order="cache"` works unchanged."""
        messages = list(messages)
        return messages, self.layout.lay_out(messages, record=False).placed

    def wire_messages(self, messages) -> list[dict]:
        """The OpenAI messages a chat request with `messages` would send (nothing is remembered)."""
        return self._sent_messages(self.layout.lay_out(list(messages), record=False))

    def _sent_messages(self, prompt) -> list[dict]:
        """The prompt's messages as sent: content parts kept (documents as document parts) and earlier
        thinking (reasoning_content) for our own server, which caches documents itself and templates
        the thinking; parts joined as text, no thinking, for any other. The server is asked what it
        is only for a prompt with parts (thinking alone goes only where the answer is known already:
        the classes ask it on every request; a server without /v1/models still answers plain ones)."""
        if prompt.part_messages == prompt.messages:
            return prompt.messages
        plain = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in prompt.part_messages]
        if self._info is None and plain == prompt.messages:     # thinking only: not worth a question to the server
            return prompt.messages
        return prompt.part_messages if self.server_info().takes_documents else prompt.messages

    # ---- requests -----------------------------------------------------------------------------
    def stream_chat(self, messages, *, template_kwargs: dict | None = None, tools: list[dict] | None = None,
                    tool_choice=None, response_format: dict | None = None, **params) -> GenerationStream:
        """Stream a chat reply: text deltas, then `.generation` (a RemoteGeneration)."""
        prompt = self.layout.lay_out(list(messages))
        extras = dict(tools=tools, tool_choice=tool_choice, response_format=response_format,
                      template_kwargs=template_kwargs)
        make_body = lambda: chat_body(self.model_name, self._sent_messages(prompt), params, **extras)  # noqa: E731
        return self._stream(prompt.route_key, "chat", make_body, self._moved(prompt))

    def chat(self, messages, **params) -> RemoteGeneration:
        return self.stream_chat(messages, **params).collect()

    def stream(self, prompt: str, **params) -> GenerationStream:
        """Stream a plain-text completion of `prompt` (no chat template)."""
        if not isinstance(prompt, str) or not prompt:
            raise InputError("a completion needs a non-empty prompt string")
        return self._stream(route_key_of_text(prompt), "completion",
                            lambda: completion_body(self.model_name, prompt, params))

    def generate(self, prompt: str, **params) -> RemoteGeneration:
        return self.stream(prompt, **params).collect()

    def _stream(self, key: int, kind: str, make_body, moved: list[str] | None = None) -> GenerationStream:
        """A GenerationStream over the dispatcher; the body (and the model name) made on first next()."""
        cancel = CancelEvent()          # cancelling cuts a read in flight at once

        def run():
            if cancel.is_set():         # closed before its first delta was asked for: send nothing
                return RemoteGeneration(finish_reason="cancelled")
            gen = yield from self.dispatch.run(key, kind, make_body(), cancel)
            gen.volatile_moved = moved
            return gen
        return GenerationStream(run(), cancel)

    def _moved(self, prompt) -> list[str] | None:
        """The sentences the layout moved (a list with the opt-in volatile="last", else None)."""
        return list(prompt.moved_volatile) if self.layout.options.volatile == "last" else None

    # ---- async ---------------------------------------------------------------------------------
    async def astream_chat(self, messages, *, template_kwargs: dict | None = None, tools: list[dict] | None = None,
                           tool_choice=None, response_format: dict | None = None,
                           **params) -> AsyncIterator[str | RemoteGeneration]:
        """Text deltas, then the RemoteGeneration, through the async client (on the event loop)."""
        prompt = self.layout.lay_out(list(messages))
        model, messages = await asyncio.to_thread(lambda: (self.model_name, self._sent_messages(prompt)))
        body = chat_body(model, messages, params, tools=tools, tool_choice=tool_choice,
                         response_format=response_format, template_kwargs=template_kwargs)
        async for item in self.dispatch.arun(prompt.route_key, "chat", body):
            if isinstance(item, RemoteGeneration):
                item.volatile_moved = self._moved(prompt)
            yield item

    async def astream(self, prompt: str, **params) -> AsyncIterator[str | RemoteGeneration]:
        """`stream` through the async client: text deltas, then the RemoteGeneration."""
        if not isinstance(prompt, str) or not prompt:
            raise InputError("a completion needs a non-empty prompt string")
        model = await asyncio.to_thread(lambda: self.model_name)
        async for item in self.dispatch.arun(route_key_of_text(prompt), "completion", completion_body(model, prompt, params)):
            yield item

    # ---- telemetry and lifecycle -------------------------------------------------------------------
    def cache_report(self) -> dict:
        """Per replica and in total: requests, prompt and cached tokens, hit rate, mean TTFT, and
        the server's own prefix-cache counters since this engine's first request to it."""
        down = {name for name, state in self.router.state().items() if state["down"]}
        current = {name: replica.prefix_counters() for name, replica in self.replicas.items()
                   if not self.report.needs_baseline(name) and name not in down}
        report = self.report.snapshot(current)
        report["routing"] = {"policy": self.router.policy, "replicas": self.router.state()}
        return report

    def format_cache_report(self) -> str:
        """`cache_report()` as a small text table."""
        return format_report(self.cache_report())

    def stats(self) -> dict:
        return self.cache_report()

    def close(self) -> None:
        """Close every replica's clients, the async ones included (see `aclose` inside a loop); one
        that fails to close does not keep the others open (its error is raised after them)."""
        failed = None
        for replica in self.replicas.values():
            try:
                replica.close()
            except Exception as err:  # noqa: BLE001 - close the rest first
                failed = failed or err
        if failed is not None:
            raise failed

    async def aclose(self) -> None:
        """`close` from async code: the async clients of the running loop are closed before it returns."""
        for replica in self.replicas.values():
            await replica.aclose()

    def __enter__(self) -> "RemoteEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    async def __aenter__(self) -> "RemoteEngine":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
