"""The remote backend: the framework classes over OpenAI-compatible servers (vLLM, llama-server).

`ChatKVBoost(endpoint=...)`, `KVBoostLLM(endpoint=...)` and LlamaIndex `KVBoost(endpoint=...)`
resolve a `RemoteEngine` instead of loading a model; everything else stays the same. Modules:
layout (cache-friendly prompts), routing (consistent hashing with bounded loads, failover),
client (the `openai` client, timeouts), dispatch (failover), errors, generation (the result),
telemetry (/metrics), tokens (counting).

Needs the extra: `pip install "kvboost-integrations[remote]"`.
"""
from __future__ import annotations

import difflib

from kvboost_engine import InputError

from .client import Replica
from .errors import BadReplyError, EngineClosedError, ReplicaError, ReplicaUnavailableError, ReplyInterruptedError
from .engine import REMOTE_OPTIONS, RemoteEngine, RemotePrompt
from .generation import RemoteGeneration
from .layout import DOCUMENT_ORDERS, VOLATILE_PATTERNS, LayoutOptions, PromptLayout
from .routing import POLICIES, HashRing, Router
from .telemetry import format_report, parse_metrics, prefix_counters

__all__ = ["RemoteEngine", "Replica", "RemoteGeneration", "RemotePrompt", "ReplicaUnavailableError", "connect",
           "ReplicaError", "ReplyInterruptedError", "BadReplyError", "EngineClosedError",
           "REMOTE_OPTIONS", "LayoutOptions", "PromptLayout", "DOCUMENT_ORDERS", "VOLATILE_PATTERNS", "Router",
           "HashRing", "POLICIES", "format_report", "parse_metrics", "prefix_counters", "is_remote"]


def connect(endpoint: str | list[str], *, api_key: str | None = None, served_model: str | None = None,
            timeout: float | None = None, max_retries: int = 0, options: dict | None = None,
            document_order: str | None = None) -> RemoteEngine:
    """A RemoteEngine for a framework class: `options` (its `engine_kwargs`) checked by name;
    `document_order` (the class's field, when set) unless the options name one. `timeout` (the
    class's overall one) caps the connect and read timeouts (`connect_timeout_s`, `read_timeout_s`)."""
    options = dict(options or {})
    if document_order is not None:
        options.setdefault("document_order", document_order)
    unknown = [name for name in options if name not in REMOTE_OPTIONS]
    if unknown:
        hints = "; ".join(f"{name!r}" + "".join(f" (did you mean {c!r}?)" for c in
                                               difflib.get_close_matches(name, REMOTE_OPTIONS, n=1, cutoff=0.6))
                          for name in unknown)
        raise InputError(f"unknown remote option(s) in engine_kwargs: {hints}. Accepted with an endpoint: "
                         f"{', '.join(REMOTE_OPTIONS)}")
    return RemoteEngine(endpoint, api_key=api_key, served_model=served_model, timeout=timeout,
                        max_retries=max_retries, **options)


def is_remote(engine) -> bool:
    """Whether `engine` is a RemoteEngine (the server templates, calls tools and guides JSON itself)."""
    return isinstance(engine, RemoteEngine)
