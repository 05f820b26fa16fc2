"""`KVBoost`: a LlamaIndex LLM on the embedded engine, reusing prompt KV across requests."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Dict, List, Optional, Union

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.llm import LLM

from kvboost_engine import Engine, InputError

from .._bridge import resolve_engine
from .._options import check_arguments, engine_options
from ..remote import RemoteEngine, connect
from .calls import EngineCall, ResponseShaper, alast, last
from .messages import ModelTokenizer, to_engine_messages

_SAMPLING = ("max_new_tokens", "temperature", "top_p", "top_k", "stop", "seed")
_LOCAL_OPTIONS = ("model", "device", "dtype", "cache_bytes", "chunk_tokens", "moved_reuse")
DOCUMENT_ORDERS = ("relevance", "cache")


class KVBoost(LLM):
    """A chat LLM for LlamaIndex that encodes repeated prompt text once.

    System prompts, chat history and retrieved nodes are cached as KV chunks in an embedded
    engine and reused by later requests. Engines are shared: objects with the same `model`
    and engine options (also LangChain ones) use one engine and one cache.

    Example:
        ```python
        from kvboost_integrations.llama_index import KVBoost
        llm = KVBoost()                       # the default SmolLM2-135M-Instruct
        query_engine = index.as_query_engine(llm=llm)
        ```

    Every response's `raw` has `usage` (prompt/completion tokens, read by
    TokenCountingHandler) and `kvboost` (reused tokens by kind, recomputed tokens, TTFT).
    """

    model: Optional[str] = Field(default=None, description="A named model (gemma3-270m), HF directory, .gguf file or hub id; None: the default model.")
    max_new_tokens: int = Field(default=256, gt=0, description="Most tokens to generate per call.")
    temperature: float = Field(default=0.0, ge=0.0, description="0 = greedy decoding.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, description="0 = no top-k cut.")
    stop: Optional[List[str]] = Field(default=None, description="Stop strings (never part of the output).")
    seed: Optional[int] = Field(default=None, description="Sampling seed.")
    context_window: Optional[int] = Field(default=None, gt=0, description="Override of the model's context window.")
    template_kwargs: Dict[str, Any] = Field(default_factory=dict, description="Extra chat-template variables.")
    device: Optional[str] = Field(default=None, description="Engine device; None: CUDA if present, else CPU.")
    dtype: Optional[str] = Field(default=None, description="Engine dtype, e.g. 'float32' or 'bfloat16'.")
    cache_bytes: Optional[int] = Field(default=None, ge=0, description="KV cache budget in bytes.")
    chunk_tokens: Optional[int] = Field(default=None, gt=0, description="Largest cached chunk, in tokens.")
    moved_reuse: Optional[str] = Field(default=None, description=(
        "Documents cached at another position: None/'full' (default: exact reuse only, replies identical to no "
        "cache), 'blend' (approximate: faster, changes some answers; see the README), 'none'."))
    document_order: str = Field(default="relevance", description=(
        "'cache': document parts that continue a cached prefix go first (exact reuse; see "
        "Engine.order_documents); the others keep their order. Also a per-call keyword. With `endpoint`, the "
        "remote layout orders documents cache-first unless this is set to 'relevance'."))
    engine_kwargs: Optional[Dict[str, Any]] = Field(default=None, description=(
        "Any other option of Engine.from_pretrained (kv_pool_bytes, disk_cache_dir, recompute_ratio, ...); "
        "with `endpoint`, options of kvboost_integrations.remote.RemoteEngine (routing, document_order, ...)."))
    endpoint: Optional[Union[str, List[str]]] = Field(default=None, description=(
        "An OpenAI-compatible server (vLLM, llama-server), e.g. 'http://127.0.0.1:8000/v1', or a list of "
        "replicas: requests go there instead of to an embedded model."))
    api_key: Optional[str] = Field(default=None, exclude=True, repr=False, description="The servers' API key.")
    served_model: Optional[str] = Field(default=None, description="Model name to request (None: the first listed).")

    _engine: Optional[Union[Engine, RemoteEngine]] = PrivateAttr(default=None)
    _custom_completion_to_prompt: bool = PrivateAttr(default=False)

    def __init__(self, *, engine: Optional[Union[Engine, RemoteEngine]] = None, **data: Any):
        """`engine`: use this engine instead of the shared one for `model` and options."""
        check_arguments(type(self).__name__, data, set(type(self).model_fields))
        local = [name for name in _LOCAL_OPTIONS if data.get(name) is not None] + (["engine"] if engine else [])
        if data.get("endpoint") is not None and local:
            raise InputError(f"{', '.join(local)} configure an embedded engine; they cannot be used with endpoint=")
        super().__init__(**data)
        self._engine = engine
        self._custom_completion_to_prompt = data.get("completion_to_prompt") is not None

    @classmethod
    def class_name(cls) -> str:
        return "KVBoost"

    @property
    def engine(self) -> Union[Engine, RemoteEngine]:
        """The engine behind this LLM (loaded on first use)."""
        if self._engine is None and self.endpoint is not None:
            self._engine = connect(self.endpoint, api_key=self.api_key, served_model=self.served_model,
                                   options=self.engine_kwargs,
                                   document_order=_set_order(self))
        if self._engine is None:
            options = engine_options(self.engine_kwargs, device=self.device, dtype=self.dtype,
                                     cache_bytes=self.cache_bytes, chunk_tokens=self.chunk_tokens,
                                     moved_reuse=self.moved_reuse)
            self._engine = resolve_engine(None, self.model, options)
        return self._engine

    @property
    def metadata(self) -> LLMMetadata:
        engine = self.engine
        return LLMMetadata(
            context_window=self.context_window or engine.context_window,
            num_output=self.max_new_tokens,
            is_chat_model=True,
            is_function_calling_model=False,
            model_name=engine.model_name,
        )

    def to_payload(self) -> Dict[str, Any]:
        """Settings for callbacks and instrumentation; does not load the engine."""
        payload = {"class_name": self.class_name(), "model": self.model, **self._params({})}
        if self._engine is not None:
            payload.update(self.metadata.model_dump())
        return payload

    @property
    def tokenizer(self) -> ModelTokenizer:
        """The model's tokenizer as LlamaIndex wants it: `Settings.tokenizer = llm.tokenizer`."""
        return ModelTokenizer(self.engine.tokenizer)

    def count_prompt_tokens(self, messages: Sequence[ChatMessage]) -> int:
        """Prompt tokens these messages take, chat template included."""
        return self.engine.count_tokens(to_engine_messages(messages))

    # ---- requests ----------------------------------------------------------------------
    def _params(self, overrides: dict) -> dict:
        """Sampling parameters: the fields, overridden by per-call kwargs (None keeps the field)."""
        extra = dict(overrides)
        if "max_tokens" in extra:
            extra["max_new_tokens"] = extra.pop("max_tokens")
        unknown = sorted(set(extra) - set(_SAMPLING))
        if unknown:
            raise InputError(f"KVBoost got unknown arguments {unknown}; it accepts {', '.join(_SAMPLING)}, max_tokens")
        params = {name: getattr(self, name) for name in _SAMPLING}
        params.update({name: value for name, value in extra.items() if value is not None})
        return params

    def _chat_call(self, messages: Sequence[ChatMessage], kwargs: dict) -> EngineCall:
        kwargs = dict(kwargs)
        order = kwargs.pop("document_order", None) or self.document_order
        if order not in DOCUMENT_ORDERS:
            raise InputError(f"document_order must be one of {', '.join(DOCUMENT_ORDERS)}, got {order!r}")
        return EngineCall(lambda: self.engine, self._params(kwargs), messages=to_engine_messages(messages),
                          template_kwargs=self.template_kwargs, document_order=order)

    def _completion_call(self, prompt: str, formatted: bool, kwargs: dict) -> EngineCall:
        """`formatted` prompts (or a custom completion_to_prompt) go in as plain text; otherwise
        the prompt is one user message (after `system_prompt`) through the model's chat template."""
        if not isinstance(prompt, str):
            raise InputError(f"complete() takes the prompt as a string, got {type(prompt).__name__} ({prompt!r:.60})")
        if formatted or self._custom_completion_to_prompt:
            text = prompt if formatted else self.completion_to_prompt(prompt)
            return EngineCall(lambda: self.engine, self._params(kwargs), prompt=text)
        messages = self._extend_messages([ChatMessage(role=MessageRole.USER, content=prompt)])
        return self._chat_call(messages, kwargs)

    @staticmethod
    def _chats(call: EngineCall) -> ChatResponseGen:
        shaper = ResponseShaper(call)
        return (shaper.chat(item) for item in call.events())

    @staticmethod
    def _completions(call: EngineCall) -> CompletionResponseGen:
        shaper = ResponseShaper(call)
        return (shaper.completion(item) for item in call.events())

    @staticmethod
    async def _achats(call: EngineCall) -> ChatResponseAsyncGen:
        shaper = ResponseShaper(call)
        async for item in call.aevents():
            yield shaper.chat(item)

    @staticmethod
    async def _acompletions(call: EngineCall) -> CompletionResponseAsyncGen:
        shaper = ResponseShaper(call)
        async for item in call.aevents():
            yield shaper.completion(item)

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        """Answer chat messages (document blocks stay separate cached parts)."""
        return last(self._chats(self._chat_call(messages, kwargs)))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        """Like `chat`, one response per text delta; the last one carries usage and telemetry."""
        return self._chats(self._chat_call(messages, kwargs))

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """Complete a prompt: a user message through the chat template, or plain text if `formatted`."""
        return last(self._completions(self._completion_call(prompt, formatted, kwargs)))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        """Like `complete`, one response per text delta; the last one carries usage and telemetry."""
        return self._completions(self._completion_call(prompt, formatted, kwargs))

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        """`chat` decoded off the event loop; cancelling the task stops decoding."""
        return await alast(self._achats(self._chat_call(messages, kwargs)))

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        """`stream_chat` as an async generator, decoded off the event loop."""
        return self._achats(self._chat_call(messages, kwargs))

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """`complete` decoded off the event loop; cancelling the task stops decoding."""
        return await alast(self._acompletions(self._completion_call(prompt, formatted, kwargs)))

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False,
                               **kwargs: Any) -> CompletionResponseAsyncGen:
        """`stream_complete` as an async generator, decoded off the event loop."""
        return self._acompletions(self._completion_call(prompt, formatted, kwargs))


def _set_order(settings) -> str | None:
    """The document_order field when it was given (it then reaches a remote engine's layout)."""
    return settings.document_order if "document_order" in settings.model_fields_set else None
