"""Errors raised by the engine. Every input error names the limit it broke."""


class KVBoostError(Exception):
    """Base class of all kvboost errors."""


class InputError(KVBoostError, ValueError):
    """A request or argument is malformed (empty prompt, unknown role, bad parameter)."""


class ContextWindowError(InputError):
    """Prompt plus requested new tokens do not fit the model's context window."""


class ModelNotFoundError(KVBoostError, FileNotFoundError):
    """A model path does not exist or a hub id cannot be fetched."""


class UnsupportedModelError(KVBoostError):
    """The architecture (or a feature of it) is not in the table of supported models."""


class BudgetError(KVBoostError):
    """A memory budget cannot hold what was asked (for example, pinning more than the cache holds)."""


class QueueFullError(BudgetError):
    """The engine is busy: too many requests wait for a running slot (`max_waiting`), or one waited
    longer than `queue_timeout_s`. Retrying later can succeed (a server answers 429)."""


class RequestTimeoutError(KVBoostError, TimeoutError):
    """A request's own timeout passed before its result came (the request is cancelled)."""
