"""Engines shared across callers: the same model and options give the same engine.

Loading a model is expensive; integrations (and users) ask here instead of constructing
engines, so two LangChain/LlamaIndex objects with the same settings use one engine and one
cache.
"""
from __future__ import annotations

import os
import threading

from .engine import Engine
from .named_models import named_model


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
    name = None if model is None else os.path.abspath(os.fspath(model)) if os.path.exists(os.fspath(model)) else os.fspath(model)
    named = named_model(name) if isinstance(name, str) and not os.path.exists(name) else None
    if named is not None:
        name = named.name                   # a named model and its package name are one model
    return (name, tuple(sorted((k, repr(v)) for k, v in options.items())))


_REGISTRY = EngineRegistry()


def shared_engine(model=None, **options) -> Engine:
    """The process-wide engine for `model` and `options` (loaded on first use)."""
    return _REGISTRY.get(model, **options)


def release_shared_engines(model=None, **options) -> int:
    """Close the process-wide engines (all, or the one of `model` and `options`) and free their memory;
    the next user of those settings loads a new one. Returns how many were closed."""
    return _REGISTRY.release(model, **options)
