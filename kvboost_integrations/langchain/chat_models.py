"""ChatKVBoost: a LangChain chat model on the embedded kvboost engine."""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from operator import itemgetter
from typing import Any

from langchain_core.language_models import BaseChatModel, LanguageModelInput, LangSmithParams
from langchain_core.language_models.chat_models import agenerate_from_stream, generate_from_stream
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass

from kvboost_engine import Generation, GenerationStream

from .._bridge import aiter_stream_timeout, iter_stream
from .._guided import json_stream, tool_call_stream
from ._settings import KVBoostSettings, response_metadata, usage_metadata
from .messages import to_engine_messages
from .tools import (TOOL_CLOSE, TOOL_OPEN, ToolCallSplitter, add_tool_prompt, normalize_tool_choice,
                    template_supports_tools)

_NO_ARGS = {"type": "object", "properties": {}}


class ChatKVBoost(KVBoostSettings, BaseChatModel):
    """Chat model that encodes repeated prompt text (system prompt, history, documents) once.

    A drop-in for ChatHuggingFace/HuggingFacePipeline chat use: same messages in, AIMessage out,
    with real streaming and async (generation runs off the event loop; cancelling stops it),
    stop strings, usage_metadata, and response_metadata carrying finish_reason, reused tokens
    by kind and time to first token.

    Example:
        ```python
        from kvboost_integrations.langchain import ChatKVBoost

        llm = ChatKVBoost()                      # default model, loaded on first use
        llm.invoke("Hello").response_metadata["reused_tokens"]
        ```
    """

    @property
    def _llm_type(self) -> str:
        return "kvboost-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.model_name, "temperature": self.temperature, "max_tokens": self.max_tokens,
                "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed, "stop": self.stop}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        return LangSmithParams(**self.ls_params(stop, kwargs, "chat"))

    # ---- requests (streaming written once; the rest aggregates it) -----------------------
    def _prepare(self, messages: list[BaseMessage], stop: list[str] | None,
                 kwargs: dict[str, Any]) -> tuple[Callable[[], GenerationStream], "_Reply"]:
        tools = kwargs.pop("tools", None) or []
        names = [tool["function"]["name"] for tool in tools]
        choice = normalize_tool_choice(kwargs.pop("tool_choice", None), names) if tools else "none"
        response_format = kwargs.pop("response_format", None)
        params = self.sampling_params(stop, kwargs)
        tools_active = bool(tools) and choice != "none" and response_format is None

        reply = _Reply(self.model_name, tools_active)

        def start() -> GenerationStream:     # runs in the worker thread for async calls
            return self._open(messages, tools if tools_active else [], choice, response_format, params, reply)

        return start, reply

    def _open(self, messages: list[BaseMessage], tools: list[dict], choice: str, response_format,
              params: dict, reply: "_Reply") -> GenerationStream:
        engine = self.get_engine()
        native = bool(tools) and template_supports_tools(engine.tokenizer)
        chat = to_engine_messages(messages, native_tools=native)
        if self.document_order == "cache":
            chat, reply.documents_from_cache = engine.order_documents(chat)
        if response_format is not None:
            return json_stream(engine, self.vocabulary(), chat, response_format, **params)
        if not tools:
            return engine.stream_chat(chat, **params)
        template_kwargs = {"tools": tools} if native else {}
        chat = chat if native else add_tool_prompt(chat, tools)
        if choice == "auto":
            return engine.stream_chat(chat, template_kwargs=template_kwargs, **params)
        schemas = {t["function"]["name"]: t["function"].get("parameters") or _NO_ARGS for t in tools
                   if choice == "any" or t["function"]["name"] == choice}
        return tool_call_stream(engine, self.vocabulary(), chat, schemas, prefix=TOOL_OPEN + "\n",
                                suffix="\n" + TOOL_CLOSE, template_kwargs=template_kwargs, **params)

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None, run_manager=None,
                **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        start, reply = self._prepare(messages, stop, kwargs)
        for item in iter_stream(start, self.timeout):
            chunk = reply.chunk(item)
            if chunk is not None:
                if run_manager and chunk.text:
                    run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None, run_manager=None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        start, reply = self._prepare(messages, stop, kwargs)
        async for item in aiter_stream_timeout(start, self.timeout):
            chunk = reply.chunk(item)
            if chunk is not None:
                if run_manager and chunk.text:
                    await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None, run_manager=None,
                  **kwargs: Any) -> ChatResult:
        return generate_from_stream(self._stream(messages, stop, run_manager, **kwargs))

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None, run_manager=None,
                         **kwargs: Any) -> ChatResult:
        return await agenerate_from_stream(self._astream(messages, stop, run_manager, **kwargs))

    # ---- tools and structured output ------------------------------------------------------
    def bind_tools(self, tools: Sequence[dict[str, Any] | type | Callable | BaseTool], *,
                   tool_choice: str | dict | bool | None = None, **kwargs: Any) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools (LangChain tools, functions, Pydantic models or OpenAI/JSON-schema dicts).

        tool_choice: "auto" (default; the model decides), "none", "any"/"required" (a call is
        forced, written by constrained decoding) or a tool name (that tool is forced).
        """
        formatted = [convert_to_openai_tool(tool) for tool in tools]
        choice = normalize_tool_choice(tool_choice, [t["function"]["name"] for t in formatted])
        return super().bind(tools=formatted, tool_choice=choice, **kwargs)

    def with_structured_output(self, schema: dict | type, *, method: str = "json_schema", include_raw: bool = False,
                               strict: bool | None = None, **kwargs: Any) -> Runnable[LanguageModelInput, Any]:
        """Answers as `schema` (Pydantic class, TypedDict, or JSON schema), always valid.

        method "json_schema" (default) and "json_mode" generate the JSON by schema-guided
        constrained decoding (json_mode uses the schema too: it is always at hand);
        "function_calling" goes through a forced tool call. `strict` is accepted: output
        always follows the schema's structure.
        """
        if kwargs:
            raise ValueError(f"unsupported arguments {sorted(kwargs)}")
        if method == "function_calling":
            return super().with_structured_output(schema, include_raw=include_raw, method=method, strict=strict)
        if method not in ("json_schema", "json_mode"):
            raise ValueError(f"method must be 'json_schema', 'json_mode' or 'function_calling', got {method!r}")
        llm = self.bind(response_format=convert_to_json_schema(schema),
                        ls_structured_output_format={"kwargs": {"method": method}, "schema": schema})
        pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        parser = PydanticOutputParser(pydantic_object=schema) if pydantic else JsonOutputParser()
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        failed = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([failed], exception_key="parsing_error")


class _Reply:
    """Turns engine deltas and the final Generation into message chunks for one request."""

    def __init__(self, model_name: str, tools_active: bool):
        self.model_name = model_name
        self.splitter = ToolCallSplitter(tools_active)
        self.documents_from_cache: int | None = None

    def chunk(self, item: str | Generation) -> ChatGenerationChunk | None:
        if isinstance(item, str):
            visible = self.splitter.feed(item)
            return ChatGenerationChunk(message=AIMessageChunk(content=visible)) if visible else None
        rest, calls = self.splitter.finish()
        finish = "tool_calls" if calls else item.finish_reason
        metadata = response_metadata(item, self.model_name, finish)
        if self.documents_from_cache is not None:
            metadata["documents_from_cache"] = self.documents_from_cache
        message = AIMessageChunk(content=rest, tool_call_chunks=calls, usage_metadata=usage_metadata(item),
                                 response_metadata=metadata, chunk_position="last")
        return ChatGenerationChunk(message=message, generation_info={"finish_reason": finish})
