"""How a request ends when it does not finish normally: refused, cancelled, or failed around it.

Each helper delivers to the request's channel last and always, so a caller never waits for an
answer that will not come.
"""
from __future__ import annotations

from concurrent.futures import Future

from ..errors import BudgetError, KVBoostError
from .decode import Decoding, Request
from .generation import Generation


def internal(err: BaseException) -> KVBoostError:
    """The error a request gets when the scheduler failed around it (the cause kept)."""
    wrapped = KVBoostError(f"the request was stopped by an internal error in the engine's scheduler: "
                           f"{type(err).__name__}: {err}")
    wrapped.__cause__ = err
    return wrapped


def guarded(decoding: Decoding, action) -> None:
    """Run one request's action; if it raises, that request ends with the error."""
    try:
        action()
    except BaseException as err:  # noqa: BLE001 - handed to the caller
        decoding.fail(err)


def run_task(fn, future: Future) -> None:
    try:
        future.set_result(fn())
    except BaseException as err:  # noqa: BLE001 - handed to the caller
        future.set_exception(err)


def refuse(request: Request, err: BaseException, waited: float | None = None) -> None:
    if waited is not None and isinstance(err, BudgetError):
        err = type(err)(f"{err} (waited {waited:.1f} s for running requests to finish)")   # QueueFullError stays one
    try:
        request.on_done(Generation(prompt_tokens=len(request.prompt), finish_reason="error"))
    finally:
        request.channel.error(err)


def cancelled(request: Request) -> None:
    gen = Generation(prompt_tokens=len(request.prompt), finish_reason="cancelled")
    try:
        request.on_done(gen)
    finally:
        request.channel.done(gen)
