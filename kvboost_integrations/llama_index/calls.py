"""One LLM request, written once: start it, stream it (sync or async), shape the responses.

A request yields text deltas and then its final Generation; sync and async callers both walk
that sequence, and the non-streaming calls keep only its last response.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import aclosing, closing

from llama_index.core.base.llms.types import (ChatMessage, ChatResponse, CompletionResponse, LogProb, MessageRole,
                                              TextBlock, ThinkingBlock, ToolCallBlock)

from kvboost_engine import Engine, Generation, GenerationStream, InputError
from kvboost_engine.constrained import AnyJson, Grammar, JsonSchema

from .._bridge import aiter_stream, document_reuse, generation_metadata
from .._reasoning import ThinkingSplitter, opens_thinking, thinking_kwargs
from .._sampling import check_server
from .._toolcalls import ToolCallSplitter, ToolFormat, add_tool_prompt, forced_tools, tool_format
from ..remote import is_remote
from .messages import to_engine_messages


class EngineCall:
    """A prepared request: chat messages (or a plain prompt), sampling parameters, and optionally
    tools (OpenAI tool dicts with a normalized choice) or a grammar the output must follow.

    `start()` runs where the work runs (a worker thread for async calls), so a lazily loaded
    engine is never loaded on the event loop; the tool-call format is read there from the
    engine's chat template.
    """

    def __init__(self, get_engine: Callable[[], Engine], params: dict, *, chat: Sequence[ChatMessage] | None = None,
                 prompt: str | None = None, template_kwargs: dict | None = None, tools: list[dict] | None = None,
                 tool_choice: str = "auto", grammar: Grammar | None = None, document_order: str = "relevance",
                 timeout: float | None = None, reasoning: bool | None = None):
        assert (chat is None) != (prompt is None)
        if tools and tool_choice not in ("auto", "none") and grammar is not None:     # one grammar per reply
            raise InputError(f"tool_choice={tool_choice!r} forces a tool call and constraint={grammar.describe()} "
                             "asks for other output: give one of them")
        self.timeout = timeout
        self.reasoning = reasoning
        self.inside: bool | None = None     # set by start() when thinking is separated: the reply starts in it
        self.document_order = document_order
        self._documents_from_cache: int | None = None
        self._get_engine = get_engine
        self.params = params
        self.chat = chat
        self.prompt = prompt
        self.template_kwargs = template_kwargs or {}
        self.tools = tools or []
        self.tool_choice = tool_choice
        self.grammar = grammar
        self.format: ToolFormat | None = None          # set by start() when tools are active
        self._layout = None
        self._model_name = ""

    def start(self) -> GenerationStream:
        engine = self._get_engine()
        self._model_name = engine.model_name
        thinking = self._thinking(engine)
        if is_remote(engine):
            check_server(engine.server_info().kind, self.params)
            return self._start_remote(engine, thinking)
        params = dict(self.params)
        if self.timeout is not None:
            params["timeout_s"] = self.timeout          # the engine cancels the request past it (queueing included)
        if self.grammar is not None:
            params["constraint"] = self.grammar
        if self.chat is None:
            return engine.stream(self.prompt, **_without_stop(params))
        fmt = tool_format(engine.tokenizer)
        messages = to_engine_messages(self.chat, native_tools=fmt.native)
        template_kwargs = {**self.template_kwargs, **thinking}
        if self.tools:
            self.format = fmt
            params["skip_special_tokens"] = False
            if fmt.native:
                template_kwargs["tools"] = self.tools
            else:
                messages = add_tool_prompt(messages, self.tools)
            if self.tool_choice != "auto":
                params["constraint"] = fmt.forced_call(forced_tools(self.tools, self.tool_choice))
        if _has_documents(messages):
            if self.document_order == "cache":
                messages, self._documents_from_cache = engine.order_documents(messages)
            self._layout = engine.encode_messages(messages, **template_kwargs)
        return engine.stream_chat(messages, template_kwargs=template_kwargs or None, **_without_stop(params))

    @property
    def written(self) -> bool:
        """Whether a grammar writes the whole reply (a JSON grammar, a forced tool call)."""
        return self.grammar is not None or bool(self.tools) and self.tool_choice not in (None, "auto", "none")

    def _thinking(self, engine) -> dict:
        """The template's thinking switch for `reasoning` (refused where there is none); with it on,
        whether the reply starts inside a think block the prompt opened (`inside`)."""
        if self.reasoning is None:
            return {}
        if self.chat is None:
            if not self.reasoning:
                raise InputError("thinking=False needs chat messages (a chat template's switch); a formatted "
                                 "prompt has none")
            self.inside = False
            return {}
        kwargs = thinking_kwargs(engine.tokenizer, self.reasoning, remote=is_remote(engine), name="thinking")
        if self.reasoning:                  # a reply a grammar writes (JSON, a forced call) is all answer
            self.inside = not is_remote(engine) and not self.written and opens_thinking(
                engine.tokenizer, {**self.template_kwargs, **kwargs})
        return kwargs

    def _start_remote(self, engine, thinking: dict) -> GenerationStream:
        """Over an endpoint the server applies its template, parses tool calls (its tool parser) and
        guides JSON (`response_format`): tools and a JSON grammar go to it as they are."""
        if self.chat is None:
            if self.grammar is not None:
                raise InputError("over an endpoint, constrained output needs chat messages (a response_format)")
            return engine.stream(self.prompt, **self.params)
        messages = to_engine_messages(self.chat, native_tools=True)
        if _has_documents(messages):
            if self.document_order == "cache":
                messages, self._documents_from_cache = engine.order_documents(messages)
            self._layout = engine.encode_messages(messages)
        params = {k: v for k, v in self.params.items() if k != "stop"} if self.written else self.params
        return engine.stream_chat(messages, template_kwargs={**self.template_kwargs, **thinking} or None,
                                  tools=self.tools or None,
                                  tool_choice=self.tool_choice, response_format=_response_format(self.grammar),
                                  **params)

    def telemetry(self, gen: Generation) -> dict:
        """Our telemetry for one finished request, plus document reuse when it had documents."""
        data = {**generation_metadata(gen, self._model_name), "total_tokens": gen.prompt_tokens + gen.completion_tokens}
        if self._layout is not None:
            data.update(document_reuse(self._layout, gen))
        if self._documents_from_cache is not None:
            data["documents_from_cache"] = self._documents_from_cache
        return data

    def events(self) -> Iterator[str | Generation]:
        """Text deltas, then the Generation. Closing early cancels decoding."""
        stream = self.start()
        with stream:
            yield from stream
        yield stream.generation

    def aevents(self) -> AsyncIterator[str | Generation]:
        """Like `events`, decoded in a worker thread; cancelling the consumer cancels decoding."""
        return aiter_stream(self.start)


class ResponseShaper:
    """Turns a call's events into LlamaIndex chat or completion responses.

    Deltas give responses with the text so far (with tools, text from where a call begins is held
    back); the final Generation gives one more response whose `raw` holds `usage` (what
    TokenCountingHandler reads) and `kvboost` (our telemetry), `additional_kwargs` the same
    telemetry flat, and whose message carries the parsed calls as ToolCallBlocks. With logprobs,
    each response's `logprobs` holds those of every token so far (cumulative, like its text).
    """

    def __init__(self, call: EngineCall):
        self.call = call
        self.text = ""
        self._splitter: ToolCallSplitter | None = None
        self._calls: list[dict] = []
        self._logprobs: list[list[LogProb]] | None = None
        self._thinking: ThinkingSplitter | None = None
        self.thought = ""                   # the reply's thinking so far (with thinking=True)

    def chat(self, item: str | Generation) -> ChatResponse:
        text, delta, raw, extra = self._step(item)
        blocks = ([ThinkingBlock(content=self.thought)] if self.thought else []) + [TextBlock(text=text)]
        if isinstance(item, Generation) and self._splitter is not None:
            blocks += [_call_block(call) for call in self._calls]
        elif isinstance(item, Generation):      # calls a server parsed (over an endpoint)
            blocks += [_call_block({**call, "args": call["arguments"]}) for call in getattr(item, "tool_calls", ())]
        calls = [b for b in blocks if isinstance(b, ToolCallBlock)]
        kwargs = {"tool_calls": [_openai_call(b) for b in calls]} if calls else {}
        message = ChatMessage(role=MessageRole.ASSISTANT, blocks=blocks, additional_kwargs=kwargs)
        return ChatResponse(message=message, delta=delta, raw=raw, additional_kwargs=extra, logprobs=self._so_far())

    def completion(self, item: str | Generation) -> CompletionResponse:
        text, delta, raw, extra = self._step(item)
        if raw is not None and self.thought:
            extra = {**extra, "thinking": self.thought}         # no blocks here: the whole thinking, at the end
        return CompletionResponse(text=text, delta=delta, raw=raw, additional_kwargs=extra, logprobs=self._so_far())

    def _so_far(self) -> list[list[LogProb]] | None:
        return None if self._logprobs is None else list(self._logprobs)

    def _note_logprobs(self, item: str | Generation) -> None:
        """Deltas add their tokens' logprobs; the Generation has them all (those of held-back text too)."""
        if isinstance(item, Generation):
            if item.logprobs is not None:
                self._logprobs = [token_logprobs(entry) for entry in item.logprobs]
        elif getattr(item, "logprobs", None):
            self._logprobs = (self._logprobs or []) + [token_logprobs(entry) for entry in item.logprobs]

    def _step(self, item: str | Generation) -> tuple[str, str, dict | None, dict]:
        self._note_logprobs(item)
        if self._splitter is None and self.call.format is not None:
            self._splitter = ToolCallSplitter(self.call.format)
        if self._thinking is None and self.call.inside is not None:
            self._thinking = ThinkingSplitter(self.call.inside)
        thought, answer = self._split(item)
        self.thought += thought
        if isinstance(item, str):
            delta = self._splitter.feed(answer) if self._splitter is not None and answer else answer
            self.text += delta
            return self.text, delta, None, {"thinking_delta": thought} if thought else {}
        cut = item.finish_reason != "stop"
        head = self._splitter.feed(answer) if self._splitter is not None and answer else answer
        delta, self._calls = self._splitter.finish(cut) if self._splitter is not None else ("", [])
        delta = head + delta
        self.text += delta
        telemetry = self.call.telemetry(item)
        usage = item.usage()
        usage.update(prompt_tokens=item.prompt_tokens, completion_tokens=item.completion_tokens)
        text = self.text if self._splitter is not None or self._thinking is not None else item.text
        extra = {**telemetry, "thinking_delta": thought} if thought else telemetry
        return text, delta, {"usage": usage, "kvboost": telemetry}, extra

    def _split(self, item: str | Generation) -> tuple[str, str]:
        """(thinking, answer) of a delta, or of what is held at the end; all answer without thinking=True."""
        if self._thinking is None:
            return "", item if isinstance(item, str) else ""
        return self._thinking.feed(item) if isinstance(item, str) else self._thinking.finish()


def token_logprobs(entry: dict) -> list[LogProb]:
    """One token's logprobs as LlamaIndex holds them: the chosen token first, then the other top ones."""
    chosen = LogProb(token=entry["token"], logprob=entry["logprob"], bytes=entry.get("bytes") or [])
    others = [LogProb(token=alt["token"], logprob=alt["logprob"], bytes=alt.get("bytes") or [])
              for alt in entry.get("top_logprobs") or ()
              if alt.get("token_id", alt["token"]) != entry.get("token_id", entry["token"])]
    return [chosen, *others]


def _openai_call(block: ToolCallBlock) -> dict:
    """A call as OpenAI's message dict, also under the message's additional_kwargs["tool_calls"]: where
    LlamaIndex's own code looks (streamed structured output, chat engines' is_function, memory)."""
    args = block.tool_kwargs if isinstance(block.tool_kwargs, str) else json.dumps(block.tool_kwargs)
    return {"id": block.tool_call_id, "type": "function", "function": {"name": block.tool_name, "arguments": args}}


def _call_block(call: dict) -> ToolCallBlock:
    try:
        args = json.loads(call["args"])
    except json.JSONDecodeError:
        args = call["args"]                 # unreadable (the model's own malformed call): kept as text
    return ToolCallBlock(tool_call_id=call["id"], tool_name=call["name"] or "", tool_kwargs=args)


def _response_format(grammar: Grammar | None) -> dict | None:
    """A grammar as a server's response_format: JSON schemas and any-JSON only."""
    if grammar is None:
        return None
    if isinstance(grammar, JsonSchema):
        return grammar.schema
    if isinstance(grammar, AnyJson):
        return {"type": "json_object"}
    raise InputError(f"over an endpoint the server guides JSON only (its response_format); a {grammar.describe()} "
                     "constraint cannot be sent")


def _without_stop(params: dict) -> dict:
    """A grammar decides where constrained output ends: stop strings do not apply."""
    return {k: v for k, v in params.items() if k != "stop"} if "constraint" in params else params


def last(responses: Iterator):
    """The last item of a response stream (the one that carries usage and telemetry)."""
    final = None
    with closing(responses):
        for final in responses:
            pass
    return final


async def alast(responses: AsyncIterator):
    """`last` for async streams; a cancelled caller closes the stream (and so stops decoding)."""
    final = None
    async with aclosing(responses):
        async for final in responses:
            pass
    return final


def _has_documents(messages: list[dict]) -> bool:
    return any(isinstance(m["content"], list) and any(p["type"] == "document" for p in m["content"])
               for m in messages)
