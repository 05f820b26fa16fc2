"""KVBoostLLM: a LangChain text-completion LLM on the embedded kvboost engine."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from langchain_core.language_models import BaseLLM, LangSmithParams
from langchain_core.outputs import GenerationChunk, LLMResult

from kvboost_engine import Generation, GenerationStream

from .._bridge import aiter_stream_timeout, iter_stream
from ._settings import KVBoostSettings, response_metadata, usage_metadata


class KVBoostLLM(KVBoostSettings, BaseLLM):
    """Text-completion LLM: the prompt string is continued as is (no chat template), and only
    the continuation is returned (never the prompt). Repeated prompt text is encoded once.

    A drop-in for HuggingFacePipeline. Each generation's `generation_info` holds
    finish_reason, usage and our telemetry (reused tokens by kind, TTFT).

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
        return {"model_name": self.model_name, "temperature": self.temperature, "max_tokens": self.max_tokens,
                "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed, "stop": self.stop}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        return LangSmithParams(**self.ls_params(stop, kwargs, "llm"))

    def _prepare(self, prompt: str, stop: list[str] | None, kwargs: dict) -> Callable[[], GenerationStream]:
        params = self.sampling_params(stop, kwargs)
        return lambda: self.get_engine().stream(prompt, **params)

    def _final_chunk(self, gen: Generation) -> GenerationChunk:
        info = response_metadata(gen, self.model_name)
        info["usage_metadata"] = dict(usage_metadata(gen))
        return GenerationChunk(text="", generation_info=info)

    def _stream(self, prompt: str, stop: list[str] | None = None, run_manager=None,
                **kwargs: Any) -> Iterator[GenerationChunk]:
        for item in iter_stream(self._prepare(prompt, stop, kwargs), self.timeout):
            if isinstance(item, Generation):
                yield self._final_chunk(item)
                continue
            chunk = GenerationChunk(text=item)
            if run_manager:
                run_manager.on_llm_new_token(item, chunk=chunk)
            yield chunk

    async def _astream(self, prompt: str, stop: list[str] | None = None, run_manager=None,
                       **kwargs: Any) -> AsyncIterator[GenerationChunk]:
        async for item in aiter_stream_timeout(self._prepare(prompt, stop, kwargs), self.timeout):
            if isinstance(item, Generation):
                yield self._final_chunk(item)
                continue
            chunk = GenerationChunk(text=item)
            if run_manager:
                await run_manager.on_llm_new_token(item, chunk=chunk)
            yield chunk

    def _generate(self, prompts: list[str], stop: list[str] | None = None, run_manager=None,
                  **kwargs: Any) -> LLMResult:
        return LLMResult(generations=[[_join(self._stream(p, stop, run_manager, **kwargs))] for p in prompts])

    async def _agenerate(self, prompts: list[str], stop: list[str] | None = None, run_manager=None,
                         **kwargs: Any) -> LLMResult:
        async def one(prompt: str) -> GenerationChunk:
            chunks = [chunk async for chunk in self._astream(prompt, stop, run_manager, **kwargs)]
            return _join(chunks)

        return LLMResult(generations=[[g] for g in await asyncio.gather(*(one(p) for p in prompts))])


def _join(chunks) -> GenerationChunk:
    total = GenerationChunk(text="")
    for chunk in chunks:
        total += chunk
    return total
