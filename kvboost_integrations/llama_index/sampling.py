"""The sampling settings of LlamaIndex `KVBoost`: its fields and the one mapping onto engine parameters.

A field holds the default for every call; `additional_kwargs` overrides the fields, a call's
keyword arguments override both (OpenAI's `max_tokens` / `min_tokens` accepted as aliases).
"""
from __future__ import annotations

from typing import Annotated, Any, Dict, List, Optional

from llama_index.core.bridge.pydantic import BaseModel, BeforeValidator, Field

from kvboost_engine import InputError

from .._options import stop_list

_SAMPLING = ("max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "stop", "seed", "repetition_penalty",
             "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs")
_ALIASES = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}     # OpenAI's names, per call too


class SamplingSettings(BaseModel):
    """How KVBoost samples, what it returns besides text (logprobs, thinking) and how long a call may take."""

    max_new_tokens: int = Field(default=256, gt=0, description="Most tokens to generate per call.")
    temperature: float = Field(default=0.0, ge=0.0, description="0 = greedy decoding.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, description="0 = no top-k cut.")
    stop: Annotated[Optional[List[str]], BeforeValidator(stop_list)] = Field(
        default=None, description="Stop strings (one string: one stop; never part of the output).")
    seed: Optional[int] = Field(default=None, description="Sampling seed.")
    min_new_tokens: Optional[int] = Field(default=None, ge=0, description=(
        "Tokens generated before an end-of-sequence token may end the reply (None/0: no minimum)."))
    repetition_penalty: Optional[float] = Field(default=None, gt=0.0, description=(
        "transformers' definition: logits of tokens already in the prompt or the reply are divided by it "
        "(multiplied when negative); > 1 discourages repeats. None/1.0: off."))
    presence_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0, description=(
        "OpenAI's definition: subtracted once from the logit of every token already in the reply."))
    frequency_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0, description=(
        "OpenAI's definition: subtracted from a token's logit for each time it is in the reply."))
    logit_bias: Optional[Dict[int, float]] = Field(default=None, description=(
        "{token id: bias in [-100, 100]} added to the logits (-100 bans a token, 100 forces it)."))
    logprobs: Optional[bool] = Field(default=None, description=(
        "Each generated token's log-probability in ChatResponse.logprobs / CompletionResponse.logprobs: per "
        "token a list of LogProb, the chosen token first, then the `top_logprobs` best others."))
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20, description="With logprobs: alternatives per token.")
    additional_kwargs: Dict[str, Any] = Field(default_factory=dict, description=(
        "Sampling parameters for every call (any of the above by name, max_tokens/min_tokens too), over the "
        "fields and under per-call keyword arguments; checked at construction."))
    thinking: Optional[bool] = Field(default=None, description=(
        "Reasoning models (a chat template with a thinking switch, as Qwen3's enable_thinking): True thinks and "
        "returns the thinking as a ThinkingBlock before the answer (streamed as additional_kwargs['thinking_delta']); "
        "False turns thinking off; None leaves the template's default and the text as written. Per call too."))
    timeout: Optional[float] = Field(default=None, gt=0, description=(
        "Seconds a request may take from the call (queueing included); past it the request is cancelled and "
        "TimeoutError (RequestTimeoutError) raised. With `endpoint`, the servers' timeout."))
    context_window: Optional[int] = Field(default=None, gt=0, description=(
        "Tokens LlamaIndex may fill (prompt + answer); None: the model's context window. At most the model's."))
    num_output: Optional[int] = Field(default=None, gt=0, description=(
        "Tokens LlamaIndex reserves for the answer when it packs prompts (LLMMetadata.num_output); None: "
        "max_new_tokens."))

    def _params(self, overrides: dict) -> dict:
        """Sampling parameters (the one mapping): the fields, then `additional_kwargs`, then per-call
        kwargs (None keeps what is below); unset controls are left to the engine's defaults."""
        params = {name: getattr(self, name) for name in _SAMPLING}
        for source, layer in (("additional_kwargs", self.additional_kwargs), ("call", overrides)):
            extra = {_ALIASES.get(name, name): value for name, value in layer.items()}
            unknown = sorted(set(extra) - set(_SAMPLING))
            if unknown:
                where = "in additional_kwargs " if source == "additional_kwargs" else ""
                raise InputError(f"KVBoost got unknown arguments {where}{unknown}; it accepts "
                                 f"{', '.join(_SAMPLING)}, max_tokens, min_tokens")
            params.update({name: value for name, value in extra.items() if value is not None})
        return {name: value for name, value in params.items() if value is not None}
