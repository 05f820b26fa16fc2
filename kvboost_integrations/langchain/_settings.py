"""Settings both LangChain classes share: which engine, and how to sample."""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from langchain_core.messages.ai import UsageMetadata
from langchain_core.runnables import Runnable
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, model_validator

from kvboost_engine import Engine, Generation
from kvboost_engine.loading import DEFAULT_MODEL_NAME

from .._bridge import generation_metadata, resolve_engine, token_ids
from .._options import check_arguments, check_engine_values, local_options, stop_list
from .._sampling import CONTROLS, check_values, engine_params
from ..remote import RemoteEngine, connect

_CALL_PARAMS = CONTROLS
_LOCAL_OPTIONS = ("engine", "model", "device", "dtype", "cache_bytes", "chunk_tokens", "moved_reuse")


class KVBoostSettings(BaseModel):
    """Engine selection and standard generation parameters.

    Models with the same `model` and engine options share one engine (and one KV cache);
    it is loaded on first use, not at construction.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, protected_namespaces=())

    model: str | None = None
    """A named model ("gemma3-270m", a base model: use `KVBoostLLM`), a path to an HF model directory
    or .gguf file, a hub id, or None for the default model (SmolLM2-135M-Instruct, shipped offline)."""
    engine: Engine | RemoteEngine | None = Field(default=None, exclude=True)
    """An existing engine to use instead of `model` (its cache is shared with other users)."""
    endpoint: str | list[str] | None = None
    """An OpenAI-compatible server (vLLM, llama-server), e.g. "http://127.0.0.1:8000/v1", or a list of
    replicas: requests go there instead of to an embedded model; `engine_kwargs` then takes the
    options of `kvboost_integrations.remote.RemoteEngine` (routing, document_order, ...)."""
    api_key: str | None = Field(default=None, exclude=True, repr=False)
    """The servers' API key, with `endpoint`."""
    served_model: str | None = None
    """The model name to request from the servers (None: the first one they list)."""
    device: str | None = None
    dtype: str | None = None
    cache_bytes: int | None = None
    """Byte budget of the reusable KV cache; 0 turns reuse off. None: the engine default."""
    chunk_tokens: int | None = None
    moved_reuse: str | None = None
    """Documents found cached at another position: None/"full" (default: exact reuse only, replies
    identical to no cache), "blend" (approximate: re-rotated and partly recomputed; faster, changes
    some answers, see the README), "none" (re-rotated only)."""
    document_order: Literal["relevance", "cache"] = "relevance"
    """With "cache", documents given as content blocks that continue a cached prefix go first (exact
    reuse, no approximation; see `Engine.order_documents`); the others keep their order.
    `response_metadata["documents_from_cache"]` says how many were placed so. With `endpoint`, the
    remote layout orders documents cache-first unless this is set to "relevance"."""
    engine_kwargs: dict[str, Any] | None = None
    """Any other option of `Engine.from_pretrained` (kv_pool_bytes, disk_cache_dir, recompute_ratio, ...)."""
    temperature: float = 0.0
    """0 is greedy decoding."""
    max_tokens: int = 256
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    min_tokens: int | None = None
    """Tokens generated before an end-of-sequence token may end the reply (None/0: no minimum)."""
    repetition_penalty: float | None = None
    """transformers' definition: logits of tokens already in the prompt or the reply are divided by
    it (multiplied when negative). > 1 discourages repeats; None/1.0: off."""
    presence_penalty: float | None = None
    """OpenAI's definition, in [-2, 2]: subtracted once from the logit of every token already in the reply."""
    frequency_penalty: float | None = None
    """OpenAI's definition, in [-2, 2]: subtracted from a token's logit for each time it is in the reply."""
    logit_bias: dict[int, float] | None = None
    """{token id: bias in [-100, 100]} added to the logits (-100 bans a token, 100 forces it)."""
    logprobs: bool | None = None
    """Return each generated token's log-probability (ChatKVBoost: `response_metadata["logprobs"]`,
    in ChatOpenAI's format, on streamed chunks too; KVBoostLLM: `generation_info["logprobs"]`)."""
    top_logprobs: int | None = None
    """With `logprobs`, also the 0 to 20 most likely tokens at each position."""
    stop: Annotated[list[str] | None, BeforeValidator(stop_list)] = None
    """Stop strings of any length (one string: one stop); the stop string is not returned."""
    timeout: float | None = None
    """Seconds a request may take (checked between tokens); past it, decoding stops and TimeoutError is raised."""
    max_retries: int = 0
    """A local engine has no transient failures to retry; with `endpoint`, the openai client's retries
    on one replica (a failing replica is left for the next one in any case)."""
    streaming: bool = False
    """Accepted for compatibility; `stream()`/`astream()` always stream."""

    _engine: Engine | None = PrivateAttr(default=None)
    _bind_only: ClassVar[tuple[str, ...]] = ()         # call arguments other than sampling controls

    @model_validator(mode="before")
    @classmethod
    def _known_arguments_only(cls, data: Any) -> Any:
        if isinstance(data, dict):
            check_arguments(cls.__name__, data, set(cls.model_fields) | {f.alias for f in cls.model_fields.values()
                                                                         if f.alias})
        return data

    @model_validator(mode="after")
    def _sampling_values(self) -> "KVBoostSettings":
        check_values(self.sampling_params(None, {}))            # a bad value fails here, not at the first call
        if self.endpoint is None and self.engine is None:
            check_engine_values(local_options(self))            # an engine option's too
        return self

    @model_validator(mode="after")
    def _remote_or_local(self) -> "KVBoostSettings":
        if self.endpoint is not None:
            local = [name for name in _LOCAL_OPTIONS if getattr(self, name) is not None]
            if local:
                raise ValueError(f"{', '.join(local)} configure an embedded engine; they cannot be used with endpoint=")
        elif self.engine is not None:
            ignored = [name for name in (*_LOCAL_OPTIONS[1:], "engine_kwargs") if getattr(self, name) not in (None, {})]
            if ignored:
                raise ValueError(f"{', '.join(ignored)} configure the engine this class would load; with engine= "
                                 "they are that engine's own (set them where it is built)")
        return self

    def engine_identity(self) -> dict[str, Any]:
        """What besides the sampling controls decides a reply: the engine's settings (model, device,
        dtype, moved_reuse, engine_kwargs such as weights, or the endpoint), an engine given as
        `engine=` (its KV fingerprint: weights, dtype, quantization; a remote one's replicas) and
        document_order. Part of `_identifying_params`, so LangChain's LLM cache (keyed on them) never
        serves one configuration's reply to another; the same across processes for the same settings."""
        identity: dict[str, Any] = {name: getattr(self, name) for name in ("model", "device", "dtype", "moved_reuse",
                                                                            "endpoint", "served_model", "document_order")}
        if self.engine_kwargs:
            identity["engine_kwargs"] = repr(sorted(self.engine_kwargs.items(), key=lambda item: item[0]))
        if self.engine is not None:
            fingerprint = getattr(self.engine, "fingerprint", None)
            identity["engine"] = (fingerprint.hex() if isinstance(fingerprint, bytes)
                                  else repr(sorted(getattr(self.engine, "replicas", {}))))
            config = getattr(self.engine, "config", None)      # its options: moved_reuse, recompute_ratio...
            if config is not None:
                identity["engine_config"] = repr(config)
        return identity

    def get_engine(self) -> Engine | RemoteEngine:
        """The engine, loaded (or looked up among shared engines) on first use."""
        if self._engine is None and self.endpoint is not None:
            self._engine = connect(self.endpoint, api_key=self.api_key, served_model=self.served_model,
                                   timeout=self.timeout, max_retries=self.max_retries, options=self.engine_kwargs,
                                   document_order=_set_order(self))
        if self.endpoint is None:           # a shared engine closed or released meanwhile is looked up again
            self._engine = resolve_engine(self.engine, self.model, local_options(self), held=self._engine)
        return self._engine

    def __getstate__(self) -> dict:
        """Pickled without its engine (a copy looks the shared one up again on first use); one given
        as engine= cannot be pickled (an engine holds threads and memory)."""
        if self.engine is not None:
            raise TypeError(f"{type(self).__name__}(engine=...) cannot be pickled: construct it with model= and "
                            "options (a copy then loads, or shares, the same engine)")
        state = super().__getstate__()
        return {**state, "__pydantic_private__": {**(state.get("__pydantic_private__") or {}), "_engine": None}}

    def __deepcopy__(self, memo: dict | None = None):
        """A deep copy that shares the engine (engines are shared by design, and hold threads)."""
        memo = {} if memo is None else memo
        for engine in (self.engine, self._engine):
            if engine is not None:
                memo[id(engine)] = engine
        return super().__deepcopy__(memo)

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids of `text` with the model's own tokenizer (no special tokens), offline for a local
        model; with `endpoint`, the server's `/tokenize` (or `engine_kwargs["tokenizer"]`). A
        `custom_get_token_ids` given to the constructor takes precedence. `get_num_tokens` counts these."""
        if self.custom_get_token_ids is not None:
            return self.custom_get_token_ids(text)
        return token_ids(self.get_engine(), text)

    @property
    def model_name(self) -> str:
        engine = self.engine or self._engine
        if engine is not None:
            return engine.model_name
        return self.served_model or self.model or ("remote" if self.endpoint else DEFAULT_MODEL_NAME)

    def sampling_params(self, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Engine sampling parameters (the one mapping): per-call kwargs over the instance's settings."""
        unknown = sorted(k for k in kwargs if k not in _CALL_PARAMS and not k.startswith("ls_"))
        if unknown:
            raise ValueError(f"unsupported call parameters {unknown}; accepted: {', '.join(_CALL_PARAMS)}"
                             " (to use another model, create another instance)")
        params = engine_params({name: getattr(self, name) if kwargs.get(name) is None else kwargs[name]
                                for name in _CALL_PARAMS})     # a per-call None keeps the instance's setting
        params["stop"] = stop if stop is not None else self.stop
        return params

    def sampling_settings(self) -> dict[str, Any]:
        """The instance's sampling controls by name (for `_identifying_params`)."""
        return {name: getattr(self, name) for name in _CALL_PARAMS} | {"stop": self.stop}

    def bind(self, **kwargs: Any) -> Runnable:
        """`Runnable.bind`, with the arguments checked now: an unknown name or a bad value raises
        here (naming it), not at the first call."""
        self.check_bound(kwargs, self._bind_only)
        return super().bind(**kwargs)

    def check_bound(self, kwargs: dict[str, Any], others: tuple[str, ...] = ()) -> None:
        """At bind time: ValueError for an unknown argument or a bad value (not at the first call)."""
        controls = {k: v for k, v in kwargs.items() if k not in others and k != "stop"}
        check_values(self.sampling_params(kwargs.get("stop"), controls))
        if kwargs.get("reasoning") not in (None, True, False):
            raise ValueError(f"reasoning must be True, False or None, got {kwargs['reasoning']!r}")

    def ls_params(self, stop: list[str] | None, kwargs: dict[str, Any], model_type: str) -> dict[str, Any]:
        params = {"ls_provider": "kvboost", "ls_model_type": model_type,
                  "ls_model_name": kwargs.get("model") if isinstance(kwargs.get("model"), str) else self.model_name,
                  "ls_temperature": self.temperature if kwargs.get("temperature") is None else kwargs["temperature"],
                  "ls_max_tokens": self.max_tokens if kwargs.get("max_tokens") is None else kwargs["max_tokens"]}
        stop = stop if stop is not None else self.stop
        if stop:
            params["ls_stop"] = stop_list(stop)
        return params


def usage_metadata(gen: Generation) -> UsageMetadata:
    """Token usage; `input_token_details.cache_read` is the prompt tokens whose KV was reused."""
    usage = gen.usage()
    return UsageMetadata(input_tokens=usage["input_tokens"], output_tokens=usage["output_tokens"],
                         total_tokens=usage["total_tokens"],
                         input_token_details={"cache_read": gen.reused_tokens})


def response_metadata(gen: Generation, model_name: str, finish_reason: str | None = None) -> dict[str, Any]:
    """model_name, finish_reason and our telemetry (reused tokens by kind, TTFT, ...)."""
    meta = generation_metadata(gen, model_name)
    meta["model_provider"] = "kvboost"
    if finish_reason:
        meta["finish_reason"] = finish_reason
    return meta


def _set_order(settings) -> str | None:
    """The document_order field when it was given (it then reaches a remote engine's layout)."""
    return settings.document_order if "document_order" in settings.model_fields_set else None
