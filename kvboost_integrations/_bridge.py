"""What every framework adapter needs from the engine, written once.

- `resolve_engine`: an explicit engine, or the shared one for (model, options), built lazily.
- `generation_metadata`: our telemetry as a flat dict for response metadata.
- `aiter_stream`: run a GenerationStream off the event loop; cancelling the consumer stops decoding.
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable

from kvboost_engine import Engine, Generation, GenerationStream, shared_engine


def resolve_engine(engine: Engine | None, model=None, options: dict | None = None) -> Engine:
    """`engine` if given, else the process-wide engine for `model` and `options`."""
    if engine is not None:
        return engine
    return shared_engine(model, **(options or {}))


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
