"""Structured output as LlamaIndex asks for it (`structured_predict`, its async and streamed forms,
`as_structured_llm`), generated under the output class's JSON schema by constrained decoding in one
request: no tool round trip, no retries. A reply that max_new_tokens cuts short is a ValueError, never a
partial object taken for the whole; streamed, partial objects come first (every field optional).
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Type

from llama_index.core.base.llms.types import ChatResponse
from llama_index.core.bridge.pydantic import BaseModel
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.events.llm import LLMStructuredPredictEndEvent, LLMStructuredPredictStartEvent
from llama_index.core.program.utils import process_streaming_objects
from llama_index.core.prompts import BasePromptTemplate

from kvboost_engine.constrained import JsonSchema

from .tools import parse_structured

dispatcher = get_dispatcher(__name__)


class StructuredOutput:
    """The structured-output methods of `KVBoost` (a mixin before FunctionCallingLLM: they replace
    LLM's program-based ones); they use the class's chat / achat / stream_chat / astream_chat."""

    @dispatcher.span
    def structured_predict(self, output_cls: Type[BaseModel], prompt: BasePromptTemplate,
                           llm_kwargs: Optional[Dict[str, Any]] = None, **prompt_args: Any) -> BaseModel:
        """An `output_cls` object, generated under its JSON schema by constrained decoding (one
        request; no tool-call round trip, no retries). ValueError if max_new_tokens cuts it short."""
        dispatcher.event(LLMStructuredPredictStartEvent(output_cls=output_cls, template=prompt,
                                                        template_args=prompt_args))
        messages = self._extend_messages(prompt.format_messages(llm=self, **prompt_args))
        response = self.chat(messages, constraint=JsonSchema(output_cls.model_json_schema()), **(llm_kwargs or {}))
        result = parse_structured(output_cls, response)
        dispatcher.event(LLMStructuredPredictEndEvent(output=result))
        return result

    @dispatcher.span
    async def astructured_predict(self, output_cls: Type[BaseModel], prompt: BasePromptTemplate,
                                  llm_kwargs: Optional[Dict[str, Any]] = None, **prompt_args: Any) -> BaseModel:
        """`structured_predict`, decoded off the event loop."""
        dispatcher.event(LLMStructuredPredictStartEvent(output_cls=output_cls, template=prompt,
                                                        template_args=prompt_args))
        messages = self._extend_messages(prompt.format_messages(llm=self, **prompt_args))
        response = await self.achat(messages, constraint=JsonSchema(output_cls.model_json_schema()),
                                    **(llm_kwargs or {}))
        result = parse_structured(output_cls, response)
        dispatcher.event(LLMStructuredPredictEndEvent(output=result))
        return result

    def _structured_stream_call(self, output_cls: Type[BaseModel], prompt: BasePromptTemplate,
                                llm_kwargs: Optional[Dict[str, Any]] = None, **prompt_args: Any):
        """What `stream_structured_predict` (and `as_structured_llm(...).stream_chat`) yields: partial
        objects (LlamaIndex's flexible model: every field optional) as the JSON is generated under
        `output_cls`'s schema, as `structured_predict` generates it, then the whole `output_cls` object
        (ValueError if max_new_tokens cuts it short)."""
        messages = self._extend_messages(prompt.format_messages(llm=self, **prompt_args))
        responses = self.stream_chat(messages, constraint=JsonSchema(output_cls.model_json_schema()),
                                     **(llm_kwargs or {}))

        def objects():
            previous, partial = None, None
            for response in responses:
                if previous is not None:
                    partial = _partial(previous, output_cls, partial)
                    yield partial
                previous = response
            if previous is not None:
                yield parse_structured(output_cls, previous)
        return objects()

    async def _structured_astream_call(self, output_cls: Type[BaseModel], prompt: BasePromptTemplate,
                                       llm_kwargs: Optional[Dict[str, Any]] = None, **prompt_args: Any):
        """`_structured_stream_call` decoded off the event loop."""
        messages = self._extend_messages(prompt.format_messages(llm=self, **prompt_args))
        responses = await self.astream_chat(messages, constraint=JsonSchema(output_cls.model_json_schema()),
                                            **(llm_kwargs or {}))

        async def objects():
            previous, partial = None, None
            async for response in responses:
                if previous is not None:
                    partial = _partial(previous, output_cls, partial)
                    yield partial
                previous = response
            if previous is not None:
                yield parse_structured(output_cls, previous)
        return objects()


def _partial(response: ChatResponse, output_cls: Type[BaseModel], last):
    """The object the JSON so far gives (LlamaIndex's flexible model), or the last one where it cannot
    be read yet (mid-key, mid-number): never a blank object in between."""
    return process_streaming_objects(response, output_cls, cur_objects=None if last is None else [last],
                                     flexible_mode=True)
