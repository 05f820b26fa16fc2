"""Engines shared across callers: the same model and options give the same engine.

Loading a model is expensive; integrations (and users) ask here instead of constructing
engines, so two LangChain/LlamaIndex objects with the same settings use one engine and one
cache.
"""
from __future__ import annotations

import dataclasses
import os
import threading

from .config import EngineConfig
from .engine import Engine
from .errors import InputError
from .named_models import named_model
from .wiring import check_device, resolve_dtype


class EngineRegistry:
    """Thread-safe map from (model, options) to a lazily loaded Engine."""

    def __init__(self):
        self._engines: dict[tuple, Engine] = {}
        self._loading: dict[tuple, threading.Lock] = {}     # per key: one load at a time, other keys not held
        self._lock = threading.Lock()

    def get(self, model=None, **options) -> Engine:
        """The engine for `model` and `options`, loaded on first use (and again after a close():
        a closed engine is not handed out). Callers of other keys do not wait for a load."""
        key = _key(model, options)
        with self._lock:
            engine = self._engines.get(key)
            if usable(engine):
                return engine
            loading = self._loading.setdefault(key, threading.Lock())
        with loading:
            with self._lock:
                engine = self._engines.get(key)
                if usable(engine):
                    return engine
            engine = Engine.from_pretrained(model, **options)
            with self._lock:
                self._engines[key] = engine
            return engine

    def release(self, model=None, **options) -> int:
        """Close and forget shared engines: every one (no arguments), or the one of `model` and
        `options` (as given to `get`). Returns how many were closed. A caller still holding one gets
        KVBoostError from it; the framework classes look theirs up again (loaded anew on next use)."""
        with self._lock:
            if model is None and not options:
                engines, self._engines = list(self._engines.values()), {}
            else:
                engine = self._engines.pop(_key(model, options), None)
                engines = [] if engine is None else [engine]
        for engine in engines:
            engine.close()                  # outside the lock: close waits for the engine's requests
        return len(engines)

    def clear(self) -> None:
        """Close and forget every engine (`release()`)."""
        self.release()


def usable(engine) -> bool:
    """Whether a shared engine handed out earlier can still be used (it was not closed)."""
    return engine is not None and not getattr(engine, "_closed", False)


def _key(model, options: dict) -> tuple:
    """One key for one engine: the model's real path (a link or a relative path is the same folder),
    a named model by its name, and the options as the engine will run them (device and dtype resolved,
    an EngineConfig option at its default left out: given or not, the same engine)."""
    name = None if model is None else os.path.realpath(os.fspath(model)) if os.path.exists(os.fspath(model)) else os.fspath(model)
    named = named_model(name) if isinstance(name, str) and not os.path.exists(name) else None
    if named is not None:
        name = named.name                   # a named model and its package name are one model
    options = dict(options)
    try:
        device = check_device(options.get("device"))
        options.update(device=str(device), dtype=str(resolve_dtype(options.get("dtype"), device)))
    except InputError:
        pass                                # keyed as given; the load raises it
    options = {k: v for k, v in options.items() if not (k in _DEFAULTS and _same(v, _DEFAULTS[k]))}
    return (name, tuple(sorted((k, repr(v)) for k, v in options.items())))


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig) if f.default is not dataclasses.MISSING}


def _same(value, default) -> bool:
    """Whether `value` is the default: of its very type and equal (2147483648.0 is no cache_bytes the
    engine takes, and True is not 1: such a value keys its own engine, whose load refuses it)."""
    try:
        return type(value) is type(default) and bool(value == default)
    except Exception:  # noqa: BLE001 - a value that cannot be compared is not the default
        return False


_REGISTRY = EngineRegistry()


def shared_engine(model=None, **options) -> Engine:
    """The process-wide engine for `model` and `options` (loaded on first use)."""
    return _REGISTRY.get(model, **options)


def release_shared_engines(model=None, **options) -> int:
    """Close the process-wide engines (all, or the one of `model` and `options`) and free their memory;
    the next user of those settings loads a new one. Returns how many were closed."""
    return _REGISTRY.release(model, **options)
