"""One LLM request, written once: start it, stream it (sync or async), shape the responses.

A request yields text deltas and then its final Generation; sync and async callers both walk
that sequence, and the non-streaming calls keep only its last response.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import aclosing, closing

from llama_index.core.base.llms.types import ChatMessage, ChatResponse, CompletionResponse, MessageRole

from kvboost_engine import Engine, Generation, GenerationStream

from .._bridge import aiter_stream, document_reuse, generation_metadata


class EngineCall:
    """A prepared request: engine messages (or a plain prompt) plus sampling parameters.

    `start()` runs where the work runs (a worker thread for async calls), so a lazily loaded
    engine is never loaded on the event loop.
    """

    def __init__(self, get_engine: Callable[[], Engine], params: dict, *, messages: list[dict] | None = None,
                 prompt: str | None = None, template_kwargs: dict | None = None, document_order: str = "relevance"):
        assert (messages is None) != (prompt is None)
        self.document_order = document_order
        self._documents_from_cache: int | None = None
        self._get_engine = get_engine
        self.params = params
        self.messages = messages
        self.prompt = prompt
        self.template_kwargs = template_kwargs or {}
        self._layout = None
        self._model_name = ""

    def start(self) -> GenerationStream:
        engine = self._get_engine()
        self._model_name = engine.model_name
        if self.messages is None:
            return engine.stream(self.prompt, **self.params)
        if _has_documents(self.messages):
            if self.document_order == "cache":
                self.messages, self._documents_from_cache = engine.order_documents(self.messages)
            self._layout = engine.encode_messages(self.messages, **self.template_kwargs)
        return engine.stream_chat(self.messages, template_kwargs=self.template_kwargs or None, **self.params)

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

    Deltas give responses with the text so far; the final Generation gives one more response
    (empty delta) whose `raw` holds `usage` (what TokenCountingHandler reads) and `kvboost`
    (our telemetry); `additional_kwargs` holds the same telemetry flat.
    """

    def __init__(self, call: EngineCall):
        self.call = call
        self.text = ""

    def chat(self, item: str | Generation) -> ChatResponse:
        text, delta, raw, extra = self._step(item)
        message = ChatMessage(role=MessageRole.ASSISTANT, content=text)
        return ChatResponse(message=message, delta=delta, raw=raw, additional_kwargs=extra)

    def completion(self, item: str | Generation) -> CompletionResponse:
        text, delta, raw, extra = self._step(item)
        return CompletionResponse(text=text, delta=delta, raw=raw, additional_kwargs=extra)

    def _step(self, item: str | Generation) -> tuple[str, str, dict | None, dict]:
        if isinstance(item, str):
            self.text += item
            return self.text, item, None, {}
        telemetry = self.call.telemetry(item)
        usage = item.usage()
        usage.update(prompt_tokens=item.prompt_tokens, completion_tokens=item.completion_tokens)
        return item.text, "", {"usage": usage, "kvboost": telemetry}, telemetry


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
