"""The sampling controls both frameworks accept, mapped once onto the engine's parameters and
checked where they are given (constructor, bind time, call), so a bad value or a control the
backend cannot honour is an error naming it, never accepted and then ignored.

Where each control's output goes is the frameworks' business (see their modules); this module
only knows names, values and which servers honour what.
"""
from __future__ import annotations

import inspect

from kvboost_engine import InputError
from kvboost_engine.request.sampling import SamplingParams

# The frameworks' names (OpenAI's where it has one) -> the engine's.
ENGINE_NAMES = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}
CONTROLS = ("temperature", "max_tokens", "min_tokens", "top_p", "top_k", "seed", "repetition_penalty",
            "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs")
# What a kind of server is known to drop silently (refused over such an endpoint instead): name ->
# (its "off" value, why). Other servers get every control and reject what they do not know.
SERVER_LIMITS = {"llamacpp": {"min_new_tokens": (0, "llama-server has no minimum reply length")}}


def engine_params(values: dict) -> dict:
    """Controls by framework name (None: left to the engine's default) -> engine parameters."""
    return {ENGINE_NAMES.get(name, name): value for name, value in values.items() if value is not None}


def check_values(params: dict) -> None:
    """InputError naming the first bad value of engine sampling `params` (checked as the engine will),
    by the framework's name when it has another (min_tokens for min_new_tokens)."""
    try:
        SamplingParams.build(**{name: value for name, value in params.items() if name in _BUILD_ARGS})
    except InputError as err:
        said = str(err)
        given = next((name for name, engine_name in ENGINE_NAMES.items() if said.startswith(engine_name)), None)
        raise InputError(f"{given}: {said}" if given else said) from None


def check_server(kind: str, params: dict) -> None:
    """InputError for a control a server of `kind` ("vllm", "llamacpp", "openai") would ignore."""
    for name, (off, why) in SERVER_LIMITS.get(kind, {}).items():
        value = params.get(name)
        if value is not None and value != off:
            raise InputError(f"{_framework_name(name)}={value!r} cannot be honoured over this endpoint: {why}")


def _framework_name(engine_name: str) -> str:
    return next((name for name, mapped in ENGINE_NAMES.items() if mapped == engine_name), engine_name)


_BUILD_ARGS = tuple(inspect.signature(SamplingParams.build).parameters)
