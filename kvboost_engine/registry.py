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
            if engine is not None and not getattr(engine, "_closed", False):
                return engine
            loading = self._loading.setdefault(key, threading.Lock())
        with loading:
            with self._lock:
                engine = self._engines.get(key)
                if engine is not None and not getattr(engine, "_closed", False):
                    return engine
            engine = Engine.from_pretrained(model, **options)
            with self._lock:
                self._engines[key] = engine
            return engine

    def clear(self) -> None:
        with self._lock:
            self._engines.clear()


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
