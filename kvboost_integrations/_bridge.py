"""What every framework adapter needs from the engine, written once.

- `resolve_engine`: an explicit engine, or the shared one for (model, options), built lazily.
- `generation_metadata`: our telemetry as a flat dict for response metadata.
- `aiter_stream`: run a GenerationStream off the event loop; cancelling the consumer stops decoding.
- `document_reuse`: document tokens of a prompt and how many of them were reused.
- `iter_stream` / `aiter_stream_timeout`: the same with a timeout, for adapters that take one.
- `token_ids`: text -> ids with the model's own tokenizer (local, or the server's over an endpoint).
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator

from kvboost_engine import Engine, Generation, GenerationStream, shared_engine
from kvboost_engine.registry import usable
from kvboost_engine.request.tokens import TokenizedPrompt


def resolve_engine(engine: Engine | None, model=None, options: dict | None = None, held=None) -> Engine:
    """`engine` if given, else `held` (the shared engine found before) while it is open, else the
    process-wide engine for `model` and `options` (a closed or released one is looked up again)."""
    if engine is not None:
        return engine
    if usable(held):
        return held
    return shared_engine(model, **(options or {}))


def token_ids(engine, text: str) -> list[int]:
    """Token ids of `text` alone (no special tokens) with the engine's tokenizer: the model's own for
    a local engine (offline); over an endpoint the server's `/tokenize` or the local tokenizer given."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a string, got {type(text).__name__}")
    return list(engine.tokenizer(text, add_special_tokens=False)["input_ids"])


def generation_metadata(gen: Generation, model_name: str) -> dict:
    """Telemetry of one generation: finish reason, token counts, reuse by kind, TTFT."""
    return {"model_name": model_name, **gen.telemetry()}


async def aiter_stream(start: Callable[[], GenerationStream]) -> AsyncIterator[str | Generation]:
    """Yield text deltas from a stream started in a worker thread, then the final Generation.

    The event loop never blocks on the model. If the consumer stops early or its task is
    cancelled, the stream is cancelled and decoding stops before the next token.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    started: list[GenerationStream] = []
    cancelled = threading.Event()

    def post(item) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:        # the loop is gone; nobody is listening any more
            cancelled.set()

    def work() -> None:
        try:
            stream = start()
            started.append(stream)
            if cancelled.is_set():
                stream.cancel()
            for delta in stream:
                post(("delta", delta))
            post(("done", stream.generation))
        except BaseException as err:  # noqa: BLE001 - handed to the consumer
            post(("error", err))

    threading.Thread(target=work, name="kvboost-generate", daemon=True).start()
    try:
        while True:
            kind, value = await queue.get()
            if kind == "error":
                raise value
            yield value
            if kind == "done":
                return
    finally:
        cancelled.set()
        for stream in started:
            stream.cancel()


def document_reuse(prompt: TokenizedPrompt, gen: Generation) -> dict:
    """How many of a prompt's document tokens there were and how many came from the cache.

    Exact reuse is a prefix, so the document tokens inside the first `reused_exact` positions
    are counted exactly. Moved reuse is counted as document tokens (documents are the parts
    marked reusable at any position), capped at the document total.
    """
    document_tokens = 0
    in_exact_prefix = 0
    start = 0
    for end, kind in zip(prompt.chunk_ends, prompt.chunk_kinds):
        if kind == "document":
            document_tokens += end - start
            in_exact_prefix += max(0, min(end, gen.reused_exact) - start)
        start = end
    reused = min(document_tokens, in_exact_prefix + gen.reused_moved)
    return {"document_tokens": document_tokens, "document_tokens_reused": reused}


def iter_stream(start: Callable[[], GenerationStream], timeout: float | None = None) -> Iterator[str | Generation]:
    """Yield text deltas of a stream, then the final Generation (the sync twin of `aiter_stream`).

    `timeout` (seconds, checked between tokens) cancels the stream and raises TimeoutError.
    Closing this iterator early (a consumer that stops reading) cancels the stream too.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    stream = start()
    try:
        for delta in stream:
            yield delta
            _check_deadline(deadline, timeout)
        yield stream.generation
    finally:
        stream.close()


async def aiter_stream_timeout(start: Callable[[], GenerationStream],
                               timeout: float | None = None) -> AsyncIterator[str | Generation]:
    """`aiter_stream` with an overall `timeout` (seconds): past it, decoding stops and TimeoutError is raised."""
    deadline = None if timeout is None else time.monotonic() + timeout
    items = aiter_stream(start)
    try:
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                item = await asyncio.wait_for(items.__anext__(), remaining)
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                raise TimeoutError(f"generation took longer than the timeout of {timeout} s") from None
            yield item
    finally:
        await items.aclose()


def _check_deadline(deadline: float | None, timeout: float | None) -> None:
    if deadline is not None and time.monotonic() > deadline:
        raise TimeoutError(f"generation took longer than the timeout of {timeout} s")
