"""KVBoostLLM: a LangChain text-completion LLM on the embedded kvboost engine."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from langchain_core.language_models import BaseLLM, LangSmithParams
from langchain_core.outputs import GenerationChunk, LLMResult

from kvboost_engine import Generation, GenerationStream

from .._bridge import aiter_stream_timeout, iter_stream
from .._logprobs import LogprobTrail
from .._sampling import check_server
from ..remote import is_remote
from ._settings import KVBoostSettings, response_metadata, usage_metadata


class KVBoostLLM(KVBoostSettings, BaseLLM):
    """Text-completion LLM: the prompt string is continued as is (no chat template), and only
    the continuation is returned (never the prompt). Repeated prompt text is encoded once.

    A drop-in for HuggingFacePipeline. Each generation's `generation_info` holds
    finish_reason, usage and our telemetry (reused tokens by kind, TTFT), and with `logprobs`
    the tokens' log-probabilities (`generation_info["logprobs"]["content"]`, ChatOpenAI's entries).
    `generate([...])` submits its prompts together, so they share batched forwards; its
    `llm_output["token_usage"]` sums their tokens.

    Example:
        ```python
        from kvboost_integrations.langchain import KVBoostLLM

        llm = KVBoostLLM(max_tokens=64, stop=["\\n\\n"])
        llm.invoke("The three primary colours are")
        ```
    """

    @property
    def _llm_type(self) -> str:
        return "kvboost"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.model_name, **self.sampling_settings(), **self.engine_identity()}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        return LangSmithParams(**self.ls_params(stop, kwargs, "llm"))

    def _prepare(self, prompt: str, stop: list[str] | None, kwargs: dict) -> Callable[[], GenerationStream]:
        params = self.sampling_params(stop, dict(kwargs))

        def start() -> GenerationStream:
            engine = self.get_engine()
            if is_remote(engine):
                check_server(engine.server_info().kind, params)
                return engine.stream(prompt, **params)
            timeout = {} if self.timeout is None else {"timeout_s": self.timeout}   # queueing and prefill too
            return engine.stream(prompt, **params, **timeout)
        return start

    def _chunk(self, item: str | Generation, trail: LogprobTrail) -> GenerationChunk:
        """A text chunk (with its tokens' logprobs), or the final one with usage and telemetry."""
        if isinstance(item, Generation):
            info = response_metadata(item, self.model_name)
            info["usage_metadata"] = dict(usage_metadata(item))
            entries = trail.rest(item)
            if entries is not None:
                info["logprobs"] = {"content": entries}
            return GenerationChunk(text="", generation_info=info)
        trail.feed(item)
        entries = trail.take()
        return GenerationChunk(text=str(item), generation_info={"logprobs": {"content": entries}} if entries else None)

    def _chunks(self, items: Iterator[str | Generation], run_manager) -> Iterator[GenerationChunk]:
        trail = LogprobTrail()
        for item in items:
            chunk = self._chunk(item, trail)
            if run_manager and chunk.text:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    def _stream(self, prompt: str, stop: list[str] | None = None, run_manager=None,
                **kwargs: Any) -> Iterator[GenerationChunk]:
        return self._chunks(iter_stream(self._prepare(prompt, stop, kwargs), self.timeout), run_manager)

    async def _astream(self, prompt: str, stop: list[str] | None = None, run_manager=None,
                       **kwargs: Any) -> AsyncIterator[GenerationChunk]:
        trail = LogprobTrail()
        async for item in aiter_stream_timeout(self._prepare(prompt, stop, kwargs), self.timeout):
            chunk = self._chunk(item, trail)
            if run_manager and chunk.text:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    def _generate(self, prompts: list[str], stop: list[str] | None = None, run_manager=None,
                  **kwargs: Any) -> LLMResult:
        starts = [self._prepare(prompt, stop, kwargs) for prompt in prompts]     # every argument checked first
        streams: list[GenerationStream] = []
        try:
            for start in starts:
                streams.append(start())                   # all submitted now: the engine batches them
            generations = [[_join(self._chunks(iter_stream(lambda s=s: s, self.timeout), run_manager))]
                           for s in streams]
        finally:
            for stream in streams:
                stream.cancel()                           # the ones not read (an error above) stop too
        return LLMResult(generations=generations, llm_output=self._llm_output(generations))

    async def _agenerate(self, prompts: list[str], stop: list[str] | None = None, run_manager=None,
                         **kwargs: Any) -> LLMResult:
        async def one(prompt: str) -> GenerationChunk:
            chunks = [chunk async for chunk in self._astream(prompt, stop, run_manager, **kwargs)]
            return _join(chunks)

        generations = [[g] for g in await asyncio.gather(*(one(p) for p in prompts))]
        return LLMResult(generations=generations, llm_output=self._llm_output(generations))

    def _llm_output(self, generations: list[list[GenerationChunk]]) -> dict:
        """Token usage summed over the prompts (as OpenAI's LLM reports it) and the model name."""
        usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        for (chunk,) in generations:
            used = (chunk.generation_info or {}).get("usage_metadata") or {}
            usage["prompt_tokens"] += used.get("input_tokens", 0)
            usage["completion_tokens"] += used.get("output_tokens", 0)
            usage["total_tokens"] += used.get("total_tokens", 0)
        return {"token_usage": usage, "model_name": self.model_name}


def _join(chunks) -> GenerationChunk:
    total = GenerationChunk(text="")
    for chunk in chunks:
        total += chunk
    return total
