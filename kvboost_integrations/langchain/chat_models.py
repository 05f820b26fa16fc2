"""ChatKVBoost: a LangChain chat model on the embedded kvboost engine."""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, ClassVar

from langchain_core.language_models import BaseChatModel, LanguageModelInput, LangSmithParams
from langchain_core.language_models.chat_models import agenerate_from_stream, generate_from_stream
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import JsonOutputKeyToolsParser, PydanticToolsParser
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass

from kvboost_engine import GenerationStream
from kvboost_engine.constrained import AnyJson, Grammar, JsonSchema

from .._bridge import aiter_stream_timeout, iter_stream
from .._reasoning import ThinkingSplitter, opens_thinking, thinking_kwargs
from .._sampling import check_server
from .._toolcalls import ToolCallSplitter, add_tool_prompt, forced_tools, normalize_tool_choice, tool_format
from ..remote import is_remote
from ._settings import KVBoostSettings
from .messages import to_engine_messages
from .reply import ChatReply
from .structured import json_schema_of, structured_chain


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

    _bind_only: ClassVar[tuple[str, ...]] = ("tools", "tool_choice", "response_format", "parallel_tool_calls",
                                             "reasoning", "stream")

    reasoning: bool | None = None
    """Reasoning models (a chat template with a thinking switch, as Qwen3's `enable_thinking`):
    True thinks and puts the thinking in `additional_kwargs["reasoning_content"]` (streamed too),
    apart from the answer in `content`; False turns thinking off; None (default) leaves the
    template's default and the text as the model writes it. Also a per-call argument. A model
    whose template has no switch refuses True/False. Earlier turns' `reasoning_content` goes
    back to the template, which keeps or drops it (Qwen3 keeps it only after the last question)."""

    @property
    def _llm_type(self) -> str:
        return "kvboost-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.model_name, **self.sampling_settings(), **self.engine_identity(),
                "reasoning": self.reasoning}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        return LangSmithParams(**self.ls_params(stop, kwargs, "chat"))

    # ---- requests (streaming written once; the rest aggregates it) -----------------------
    def _prepare(self, messages: list[BaseMessage], stop: list[str] | None,
                 kwargs: dict[str, Any]) -> tuple[Callable[[], GenerationStream], ChatReply]:
        tools = kwargs.pop("tools", None) or []
        kwargs.pop("stream", None)              # LangChain's routing flag (invoke(..., stream=True)), not sampling
        names = [tool["function"]["name"] for tool in tools]
        requested = kwargs.pop("tool_choice", None)     # with no tools (bind_tools([])): nothing to choose
        if not tools and requested not in (None, "auto", "none", False):
            raise ValueError(f"tool_choice={requested!r} forces a tool call, but no tools are bound")
        choice = normalize_tool_choice(requested, names) if tools else "none"
        response_format = kwargs.pop("response_format", None)
        if response_format is not None and choice != "none":     # one grammar per reply (the server refuses it too)
            raise ValueError(f"tools (tool_choice={requested!r}) and response_format asks for JSON: give one of them "
                             "(or tool_choice='none')")
        parallel = kwargs.pop("parallel_tool_calls", None)
        reasoning = kwargs.pop("reasoning", self.reasoning)
        params = self.sampling_params(stop, kwargs)
        tools = tools if choice != "none" and response_format is None else []
        reply = ChatReply(self.model_name, one_call=parallel is False)

        def start() -> GenerationStream:     # runs in the worker thread for async calls
            stream = self._open(messages, tools, choice, response_format, params, reply, reasoning)
            engine = self.get_engine()          # a remote server parses tool calls itself
            reply.splitter = ToolCallSplitter(tool_format(engine.tokenizer) if tools and not is_remote(engine) else None)
            return stream

        return start, reply

    def _open(self, messages: list[BaseMessage], tools: list[dict], choice: str, response_format,
              params: dict, reply: ChatReply, reasoning: bool | None) -> GenerationStream:
        engine = self.get_engine()
        written = response_format is not None or bool(tools) and choice not in ("auto", "none")   # by a grammar
        thinking = self._thinking(engine, reasoning, reply, written)
        constrained = {k: v for k, v in params.items() if k != "stop"}   # the grammar decides the end
        if is_remote(engine):       # the server applies its template, parses tool calls and guides JSON
            check_server(engine.server_info().kind, params)
            return engine.stream_chat(to_engine_messages(messages, native_tools=True), tools=tools or None,
                                      tool_choice=choice, response_format=response_format,
                                      template_kwargs=thinking or None, **(constrained if written else params))
        if self.timeout is not None:        # the engine's own bound also covers queueing and prefill
            params = {**params, "timeout_s": self.timeout}
            constrained = {**constrained, "timeout_s": self.timeout}
        fmt = tool_format(engine.tokenizer)
        chat = to_engine_messages(messages, native_tools=fmt.native)
        if self.document_order == "cache":
            chat, reply.documents_from_cache = engine.order_documents(chat)
        if response_format is not None:
            return engine.stream_chat(chat, template_kwargs=thinking or None,
                                      constraint=response_constraint(response_format), **constrained)
        if not tools:
            return engine.stream_chat(chat, template_kwargs=thinking or None, **params)
        chat, template_kwargs = with_tools(chat, tools, fmt)
        template_kwargs.update(thinking)
        if choice == "auto":
            return engine.stream_chat(chat, template_kwargs=template_kwargs, skip_special_tokens=False, **params)
        return engine.stream_chat(chat, template_kwargs=template_kwargs, skip_special_tokens=False,
                                  constraint=fmt.forced_call(forced_tools(tools, choice)), **constrained)

    @staticmethod
    def _thinking(engine, reasoning: bool | None, reply: ChatReply, written: bool) -> dict:
        """The template's thinking switch for `reasoning` (refused when it has none); with True, the
        reply's thinking goes to `reasoning_content`, apart from the answer. A reply a grammar writes
        (`written`: JSON, a forced call) is all answer, even after a think block the prompt opened."""
        thinking = thinking_kwargs(engine.tokenizer, reasoning, remote=is_remote(engine))
        if reasoning:
            inside = not is_remote(engine) and not written and opens_thinking(engine.tokenizer, thinking)
            reply.thinking = ThinkingSplitter(inside=inside)
        return thinking

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

    # ---- token counting ---------------------------------------------------------------------
    def get_num_tokens_from_messages(self, messages: list[BaseMessage], tools: Sequence[Any] | None = None) -> int:
        """Prompt tokens of `messages` as this model receives them: its chat template (with the
        generation prompt) and `tools` (as `bind_tools` takes them) included. Offline for a local
        model; with `endpoint`, the server's tokenizer and template (or the local tokenizer given).
        This is `usage_metadata["input_tokens"]` of a call with these messages, so
        `trim_messages(history, token_counter=llm, max_tokens=...)` keeps a history inside the window."""
        if not messages:
            return 0
        formatted = [convert_to_openai_tool(tool) for tool in tools or ()]
        engine = self.get_engine()
        if is_remote(engine):
            return engine.count_tokens(to_engine_messages(messages, native_tools=True), tools=formatted or None,
                                       **thinking_kwargs(engine.tokenizer, self.reasoning, remote=True))
        fmt = tool_format(engine.tokenizer)
        chat = to_engine_messages(messages, native_tools=fmt.native)
        chat, template_kwargs = with_tools(chat, formatted, fmt) if formatted else (chat, {})
        template_kwargs.update(thinking_kwargs(engine.tokenizer, self.reasoning))
        return len(engine.encode_messages(chat, **template_kwargs))

    # ---- tools and structured output ------------------------------------------------------
    def bind_tools(self, tools: Sequence[dict[str, Any] | type | Callable | BaseTool], *,
                   tool_choice: str | dict | bool | None = None, parallel_tool_calls: bool | None = None,
                   strict: bool | None = None, **kwargs: Any) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools (LangChain tools, functions, Pydantic models or OpenAI/JSON-schema dicts).

        tool_choice: "auto" (default; the model decides), "none", "any"/"required" (a call is
        forced, written by constrained decoding) or a tool name (that tool is forced).
        parallel_tool_calls: False keeps only the first call of a reply (None/True: every call the
        model writes). strict (ChatOpenAI's) is accepted: a forced call's arguments always follow
        the schema; under "auto" the model's calls are parsed as it wrote them. Other kwargs are
        call parameters, checked here.
        """
        if strict is not None and not isinstance(strict, bool):
            raise ValueError(f"strict must be a bool or None, got {strict!r}")
        formatted = [convert_to_openai_tool(tool) for tool in tools]
        choice = normalize_tool_choice(tool_choice, [t["function"]["name"] for t in formatted])
        if parallel_tool_calls is not None:
            if not isinstance(parallel_tool_calls, bool):
                raise ValueError(f"parallel_tool_calls must be a bool, got {parallel_tool_calls!r}")
            kwargs["parallel_tool_calls"] = parallel_tool_calls
        return self.bind(tools=formatted, tool_choice=choice, **kwargs)

    def with_structured_output(self, schema: dict | type | None = None, *, method: str = "json_schema",
                               include_raw: bool = False, strict: bool | None = None,
                               **kwargs: Any) -> Runnable[LanguageModelInput, Any]:
        """Answers as `schema` (Pydantic class, TypedDict, or JSON schema), by constrained decoding.
        A JSON schema dict is followed as it is, whatever its top level (OpenAI's {"name", "schema"}
        and {"type": "json_schema", ...} forms unwrapped).

        method "json_schema" (default): the output is generated under the schema (llguidance), so
        it validates unless `max_tokens` cuts it: a cut reply (finish_reason "length") raises
        `LengthCutError` (an OutputParserException naming the budget), never a partial object;
        `include_raw=True` gives it as `parsing_error`. "json_mode": valid JSON; the schema is followed too when
        given (schema None: any JSON object, parsed to a dict). "function_calling": a forced call
        of a tool whose parameters are the schema, in the model's tool-call format. A schema
        feature that cannot be enforced raises ValueError naming it, before any decoding.
        `strict` is accepted: the output always follows the schema.
        """
        if kwargs:
            raise ValueError(f"unsupported arguments {sorted(kwargs)}")
        if method not in ("json_schema", "json_mode", "function_calling"):
            raise ValueError(f"method must be 'json_schema', 'json_mode' or 'function_calling', got {method!r}")
        if schema is None and method != "json_mode":
            raise ValueError(f"method {method!r} needs a schema (or use method='json_mode' for any JSON object)")
        pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        tracing = {} if schema is None else {"ls_structured_output_format": {"kwargs": {"method": method},
                                                                             "schema": schema}}
        if method == "function_calling":
            name = convert_to_openai_tool(schema)["function"]["name"]
            llm = self.bind_tools([schema], tool_choice=name, **tracing)
            parser = (PydanticToolsParser(tools=[schema], first_tool_only=True) if pydantic
                      else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True))
            return structured_chain(llm, parser, include_raw)
        response_format = {"type": "json_object"} if schema is None else json_schema_of(schema)
        llm = self.bind(response_format=response_format, **tracing)
        parser = PydanticOutputParser(pydantic_object=schema) if pydantic else JsonOutputParser()
        return structured_chain(llm, parser, include_raw)


def with_tools(chat: list[dict], tools: list[dict], fmt) -> tuple[list[dict], dict]:
    """(messages, template kwargs) that show `tools` to the model: through its chat template when
    the template renders tools, else as our tool prompt in the messages."""
    if fmt.native:
        return chat, {"tools": tools}
    return add_tool_prompt(chat, tools), {}


def response_constraint(response_format) -> Grammar:
    """The grammar for a `response_format`: a JSON schema, {"type": "json_object"} (any JSON object)
    or OpenAI's {"type": "json_schema", "json_schema": {"schema": ...}}."""
    if not isinstance(response_format, dict):
        raise ValueError(f"response_format must be a dict (a JSON schema), got {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind == "json_object":
        return AnyJson()
    if kind == "json_schema" and isinstance(response_format.get("json_schema"), dict):
        return JsonSchema(response_format["json_schema"].get("schema") or {})
    return JsonSchema(response_format)

