"""Reuse telemetry of one synthesis, summed over its LLM calls."""
from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

from llama_index.core.bridge.pydantic import Field
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent, LLMCompletionEndEvent

_SUMMED = ("prompt_tokens", "reused_tokens", "reused_exact", "reused_moved", "recomputed",
           "completion_tokens", "document_tokens", "document_tokens_reused", "documents_from_cache")


class SynthesisTelemetry:
    """Collects the `kvboost` telemetry from the `raw` of each LLM response.

    `data` is the dict put in `response.metadata["kvboost"]`: the sums of `_SUMMED`,
    `llm_calls`, `document_reuse` (share of document tokens that came from the cache),
    `ttft_s` of the call that produced the answer, and `calls` (each call's telemetry).
    A streamed response's `data` is complete once its stream has ended.
    """

    def __init__(self):
        self.data: dict = {"llm_calls": 0, **{name: 0 for name in _SUMMED}, "document_reuse": 0.0,
                           "ttft_s": None, "calls": []}

    def add(self, raw) -> None:
        """Count one call; responses of other LLMs (no `kvboost` in raw) count as calls only."""
        self.data["llm_calls"] += 1
        call = raw.get("kvboost") if isinstance(raw, dict) else None
        if not call:
            return
        for name in _SUMMED:
            self.data[name] += call.get(name, 0)
        if self.data["document_tokens"]:
            self.data["document_reuse"] = self.data["document_tokens_reused"] / self.data["document_tokens"]
        self.data["ttft_s"] = call.get("ttft_s")
        self.data["calls"].append(call)

    def tokens(self, responses: Iterator) -> Iterator[str]:
        """Text deltas of a streamed chat; the final response is counted when it arrives."""
        for response in responses:
            if response.delta:
                yield response.delta
            if response.raw:
                self.add(response.raw)

    async def atokens(self, responses: AsyncIterator) -> AsyncIterator[str]:
        async for response in responses:
            if response.delta:
                yield response.delta
            if response.raw:
                self.add(response.raw)


class ReuseRecorder(BaseEventHandler):
    """Collects the `kvboost` telemetry of every LLM call, wherever it was made (stock
    synthesizers, chat engines, agents), through LlamaIndex instrumentation.

    ```python
    with ReuseRecorder() as recorder:
        query_engine.query("...")
    recorder.records[-1]["reused_tokens"]
    ```
    """

    records: list = Field(default_factory=list)

    @classmethod
    def class_name(cls) -> str:
        return "ReuseRecorder"

    def handle(self, event, **kwargs) -> None:
        if isinstance(event, (LLMChatEndEvent, LLMCompletionEndEvent)) and event.response is not None:
            raw = event.response.raw
            if isinstance(raw, dict) and "kvboost" in raw:
                self.records.append(raw["kvboost"])

    def __enter__(self) -> "ReuseRecorder":
        get_dispatcher().add_event_handler(self)
        return self

    def __exit__(self, *exc) -> None:
        get_dispatcher().event_handlers.remove(self)
