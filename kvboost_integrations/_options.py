"""Engine options the framework classes accept, checked up front with a hint for near misses.

Both frameworks take the same options: the common ones as named fields (`device`, `dtype`,
`cache_bytes`, `chunk_tokens`, `moved_reuse`) and any other option of `Engine.from_pretrained`
in `engine_kwargs`. An unknown constructor argument is an error naming the accepted ones and
the closest match (`model_id` -> did you mean `model`?), never silently ignored.
"""
from __future__ import annotations

import dataclasses

from kvboost_engine import EngineConfig, InputError
from kvboost_engine.config import LOAD_OPTIONS, closest_name   # LOAD_OPTIONS: from_pretrained's beyond EngineConfig's
ENGINE_OPTIONS = tuple(f.name for f in dataclasses.fields(EngineConfig)) + LOAD_OPTIONS
# Names other wrappers use for what we call otherwise.
ALIASES = {"model_id": "model", "model_name": "model", "model_path": "model", "tokenizer_name": "model",
           "model_kwargs": "engine_kwargs", "generate_kwargs": "engine_kwargs"}


def check_arguments(owner: str, given, accepted) -> None:
    """Raise ValueError for any name in `given` that is not in `accepted`, with a hint."""
    accepted = set(accepted)
    for name in given:
        if name in accepted:
            continue
        hint = ALIASES.get(name) if ALIASES.get(name) in accepted else None
        hint = hint or closest_name(name, accepted)
        suggestion = f"; did you mean {hint!r}?" if hint else ""
        raise ValueError(f"{owner}() got an unexpected argument {name!r}{suggestion} "
                         f"Accepted: {', '.join(sorted(a for a in accepted if not a.startswith('_')))}")


def engine_options(engine_kwargs: dict | None = None, **named) -> dict:
    """The engine options a caller set (None means "engine default"), `engine_kwargs` checked.

    Leaving unset options out keeps the shared-engine key equal for classes (LangChain,
    LlamaIndex) that expose the same settings with different defaults.
    """
    extra = dict(engine_kwargs or {})
    unknown = [name for name in extra if name not in ENGINE_OPTIONS]
    if unknown:
        close = {n: closest_name(n, ENGINE_OPTIONS) for n in unknown}
        hints = "; ".join(f"{n!r}" + (f" (did you mean {c!r}?)" if c else "") for n, c in close.items())
        raise InputError(f"unknown engine option(s) in engine_kwargs: {hints}. Accepted: {', '.join(ENGINE_OPTIONS)}")
    doubled = sorted(set(extra) & {k for k, v in named.items() if v is not None})
    if doubled:
        raise InputError(f"{', '.join(doubled)} given both as a field and in engine_kwargs")
    return {name: value for name, value in {**named, **extra}.items() if value is not None}


def local_options(owner) -> dict:
    """The engine options of a framework object that loads its own engine: its fields, engine_kwargs."""
    return engine_options(owner.engine_kwargs, device=owner.device, dtype=owner.dtype, cache_bytes=owner.cache_bytes,
                          chunk_tokens=owner.chunk_tokens, moved_reuse=owner.moved_reuse)


def check_engine_values(options: dict) -> None:
    """InputError for a bad engine option value when a framework object is built (it failed at the first
    call): the checks Engine.from_pretrained runs before it loads anything."""
    from kvboost_engine.config import engine_config
    from kvboost_engine.weights.quantized import check_weights_format
    from kvboost_engine.wiring import check_device, resolve_dtype
    engine_config(None, {name: value for name, value in options.items() if name not in LOAD_OPTIONS})
    device = check_device(options.get("device"))
    check_weights_format(options.get("weights"), resolve_dtype(options.get("dtype"), device), device)


def stop_list(value):
    """A `stop` field's value: one string as a one-item list (as ChatOpenAI and the engine read it)."""
    return [value] if isinstance(value, str) else value
