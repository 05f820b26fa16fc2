"""Errors of the remote backend. Each names the replica (its /v1 URL) and what happened there.

- `ReplicaUnavailableError`: no replica answered a request (each failed before the first token
  of its reply reached the caller: unreachable, timed out, 5xx/429, a broken reply).
- `ReplyInterruptedError`: the replica answering failed after part of its reply had reached the
  caller (dropped, timed out between chunks, malformed, ended without a finish_reason). A reply
  cannot be resumed elsewhere, so this is raised instead of returning a shorter answer.
- `BadReplyError`: a replica's reply broke the protocol (no finish_reason, a chunk that is not
  a chat/completion chunk, a body that is not JSON); it counts as a replica failure.

All are `ReplicaError`s, a `KVBoostError` and a `ConnectionError`. `EngineClosedError` (a
`KVBoostError`, no replica at fault): the engine's `close()` closed the connection a request was
reading; the replica is not marked down (a later request opens new connections).
"""
from __future__ import annotations

from kvboost_engine import KVBoostError


class ReplicaError(KVBoostError, ConnectionError):
    """A remote replica failed a request. `replica`: its /v1 URL (None when several failed)."""

    def __init__(self, message: str, *, replica: str | None = None):
        super().__init__(message)
        self.replica = replica


class ReplicaUnavailableError(ReplicaError):
    """No replica answered a request. `errors`: what happened at each replica, by URL."""

    def __init__(self, message: str, *, errors: dict[str, str] | None = None):
        super().__init__(message)
        self.errors = dict(errors or {})


class ReplyInterruptedError(ReplicaError):
    """The replica failed after part of its reply had reached the caller. `received_chars`: how
    much text the caller had received (it is not a complete reply)."""

    def __init__(self, message: str, *, replica: str, received_chars: int):
        super().__init__(message, replica=replica)
        self.received_chars = received_chars


class BadReplyError(ReplicaError):
    """A replica's reply broke the OpenAI protocol (incomplete stream, malformed chunk, not JSON)."""


class EngineClosedError(KVBoostError):
    """The remote engine's close() closed the connection this request was reading (no replica failed)."""
