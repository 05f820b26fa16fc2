"""One request's decoding, token by token, on the scheduler thread: sampling (with its constraint),
text deltas with stop strings, and storing the KV of the prompt and of the reply.

The caller reads the request's deltas from its Channel (written once: streaming and non-streaming
calls both read it). Cancelling (from any thread) stops the request before its next token, and its
blocks are freed at once.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Generator
from contextlib import contextmanager
from dataclasses import dataclass

from ..errors import ContextWindowError, InputError, RequestTimeoutError
from ..instrument import FirstTokenEvent, Instruments
from ..model.arch import ModelAdapter
from .detok import TextAssembler
from .generation import Generation
from .logprobs import LogprobRecorder, TextDelta
from .prefill import Prefilled, PrefillParts
from .sampling import Sampler, SamplingParams
from .tokens import PromptTokenizer, TokenizedPrompt

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineParts:
    """What a request needs from the engine (no back-reference to the engine itself)."""

    prefill: PrefillParts
    prompt_tokenizer: PromptTokenizer
    tokenizer: object
    eos_ids: frozenset
    instruments: Instruments

    @property
    def adapter(self) -> ModelAdapter:
        return self.prefill.adapter


def check_timeout(timeout_s) -> float | None:
    """A request's timeout_s: None, or a positive finite number of seconds."""
    if timeout_s is None:
        return None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < float("inf"):
        raise InputError(f"timeout_s must be None or a positive number of seconds, got {timeout_s!r}")
    return float(timeout_s)


def check_window(parts: EngineParts, prompt_tokens: int, max_new_tokens: int) -> None:
    window = parts.adapter.context_window
    if prompt_tokens + max_new_tokens > window:
        error = ContextWindowError(f"prompt has {prompt_tokens} tokens and max_new_tokens is {max_new_tokens}: together "
                                   f"{prompt_tokens + max_new_tokens}, beyond the model's context window of {window} tokens")
        error.prompt_tokens = prompt_tokens
        raise error


def store(parts: EngineParts, prompt: TokenizedPrompt, kv, upto: int, exact_upto: int,
          extra_tokens: list[int] = (), *, pin: bool = False) -> int:
    """Insert the KV of the prompt (plus `extra_tokens` generated after it) into the cache."""
    n = len(prompt)
    limit = parts.prefill.adapter.regime_limit
    if limit is not None and n > limit:     # longrope's long factors: KV no shorter prompt computes alike
        if pin:
            raise InputError(f"a prompt of {n} tokens, past the model's original window of {limit} (longrope: "
                             "computed with its long factors), is not cached: it cannot be pinned")
        return 0
    chunk = parts.prefill.config.chunk_tokens
    tokens = prompt.token_ids + list(extra_tokens)
    ends = prompt.chunk_ends + list(range(n + chunk, upto, chunk)) + ([upto] if upto > n else [])
    kinds = prompt.chunk_kinds + ["generated"] * (len(ends) - len(prompt.chunk_ends))
    indexed = parts.prefill.config.moved_reuse != "full"      # the content index serves moved reuse only
    return parts.prefill.cache.insert(tokens, ends, upto, kv, pin=pin, exact_upto=exact_upto,
                                      chunk_kinds=kinds if indexed else None)


_held = threading.local()           # .messages: a list while this thread holds its channels' messages


@contextmanager
def messages_after():
    """Within, the calling thread's Channel messages are held and then put, in order, on exit (also
    on an error): the scheduler hands a step's deltas over at the step's end. A caller woken mid-step
    contends with the step's own sampling for the cores and the GIL: the 8 argmaxes of a batched
    int4 step took 0.40 ms with each delta put as made, 0.13 ms held (a probe on Zen 4, 2 cores)."""
    if getattr(_held, "messages", None) is not None:          # nested: the outer one puts them
        yield
        return
    _held.messages = []
    try:
        yield
    finally:
        messages, _held.messages = _held.messages, None
        for target, message in messages:
            target.put(message)


class Channel:
    """Deltas, then the Generation (or an error), from the scheduler thread to the caller."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()

    def _put(self, message: tuple) -> None:
        held = getattr(_held, "messages", None)
        if held is None:
            self._queue.put(message)
        else:
            held.append((self._queue, message))

    def delta(self, text: str) -> None:
        self._put(("delta", text))

    def done(self, gen: Generation) -> None:
        self._put(("done", gen))

    def error(self, err: BaseException) -> None:
        self._put(("error", err))

    def events(self, deadline: float | None = None) -> Generator[str, None, Generation]:
        """The caller's side: text deltas; returns the Generation. Past `deadline` (perf_counter
        seconds) without the next event: RequestTimeoutError (the stream's owner cancels)."""
        while True:
            kind, value = self._get(deadline)
            if kind == "delta":
                yield value
            elif kind == "done":
                return value
            else:
                raise value

    def _get(self, deadline: float | None) -> tuple:
        if deadline is None:
            return self._queue.get()
        try:
            return self._queue.get(timeout=max(0.0, deadline - time.perf_counter()))
        except queue.Empty:
            raise RequestTimeoutError("the request's timeout_s passed before its result came; "
                                      "it was cancelled") from None


@dataclass(slots=True)
class Request:
    """A request as submitted: what to run and where its results go."""

    prompt: TokenizedPrompt
    params: SamplingParams
    cancel: threading.Event
    channel: Channel
    on_done: Callable[[Generation], None]
    constraint: object = None
    started: float = 0.0


class Decoding:
    """A request from its first token to its end."""

    def __init__(self, parts: EngineParts, request: Request, done: Prefilled):
        self.parts, self.request = parts, request
        self.gen = Generation(prompt_tokens=len(request.prompt))
        self.sampler = Sampler(request.params, parts.adapter.device, parts.eos_ids, request.prompt.token_ids)
        self.logprobs = LogprobRecorder(parts.tokenizer, request.params.top_logprobs) if request.params.logprobs else None
        self._logprobs_sent = 0
        if self.logprobs is not None:
            self.gen.logprobs = []
        self.text = TextAssembler(parts.tokenizer, request.params.stop, request.params.skip_special_tokens)
        self.kv, self.n = done.sequence, len(request.prompt)
        self.valid, self.exact_upto = self.n, done.exact_upto    # KV positions computed / equal to a full prefill
        self.token: int | None = None
        self.finished = False
        self._delivered = False             # the caller has its result or its error
        g = self.gen
        g.reused_exact, g.reused_moved, g.recomputed = done.reused_exact, done.reused_moved, done.recomputed
        g.reused_tokens = done.reused_exact + done.reused_moved

    def begin(self, done: Prefilled) -> None:
        """The prompt is computed: choose the first token, store the prompt's KV."""
        self.token = self._choose(done.logits)
        self.gen.ttft_s = time.perf_counter() - self.request.started
        if self.parts.instruments.active:
            self.parts.instruments.emit(FirstTokenEvent(done.logits, self.n))
        self._store(self.n, self.exact_upto)
        self._take()

    def next_input(self) -> tuple:
        """(kv, [token], position) for the forward that yields the next token."""
        return self.kv, [self.token], self.valid

    def advance(self, logits) -> None:
        """The forward of `next_input` ran: choose the next token."""
        self.valid += 1
        self.token = self._choose(logits)
        self._take()

    def _choose(self, logits) -> int:
        constraint = self.request.constraint
        if constraint is None and self.logprobs is None:
            token = self.sampler.greedy(logits, len(self.gen.token_ids))
            if token is not None:
                self.sampler.accept(token)
                return token
        if constraint is not None:
            logits = constraint.mask(logits)
        logits = self.sampler.adjust(logits, len(self.gen.token_ids))
        token = self.sampler.pick(logits)
        if constraint is not None:
            if logits[token] == float("-inf"):
                raise InputError("the constraint allows no token here (its grammar cannot continue)")
            constraint.advance(token)
        self.sampler.accept(token)
        if self.logprobs is not None and token not in self.parts.eos_ids:
            self.gen.logprobs.append(self.logprobs.entry(logits, token))
        return token

    def _take(self) -> None:
        """The chosen token joins the reply; stop if it ends it."""
        gen, token = self.gen, self.token
        gen.token_ids.append(token)
        if token in self.parts.eos_ids:
            return self.finish("stop")
        delta = self.text.add(token)
        if delta:
            self.request.channel.delta(self._with_logprobs(delta))
        constraint = self.request.constraint
        if self.text.stopped_at is not None or (constraint is not None and constraint.is_finished()):
            return self.finish("stop")
        if len(gen.token_ids) >= self.request.params.max_new_tokens:
            return self.finish("length")
        if self.request.cancel.is_set():
            return self.finish("cancelled")

    def _with_logprobs(self, delta: str) -> str:
        """The delta, carrying the logprobs of the tokens since the last one when they are recorded."""
        if self.logprobs is None:
            return delta
        entries, self._logprobs_sent = self.gen.logprobs[self._logprobs_sent:], len(self.gen.logprobs)
        return TextDelta(delta, entries)

    def finish(self, reason: str) -> None:
        """End the request: store the reply's KV, free the sequence, hand over the Generation.
        A store that fails costs only the reuse of this reply (logged): the caller still gets it."""
        if self.finished:
            return
        self.finished = True
        gen = self.gen
        gen.finish_reason = reason
        try:
            tail = self._with_logprobs(self.text.finish())    # held-back text, and its tokens' logprobs
            if tail or getattr(tail, "logprobs", None):               # (entries with no text left: an empty delta)
                self.request.channel.delta(tail)
            gen.text = self.text.final_text
        except BaseException as err:  # noqa: BLE001 - the caller gets the error instead of the reply
            self.kv.release()
            return self._deliver_error(err)
        self._store_reply()
        try:
            _remember_reply(self.parts, gen, self.text)
        except Exception:  # noqa: BLE001 - a memo for the next turn's reuse, not part of the reply
            log.warning("kvboost: could not remember the reply's token ids for the next turn", exc_info=True)
        gen.total_s = time.perf_counter() - self.request.started
        self._delivered = True
        try:
            self.request.on_done(gen)
        finally:
            self.request.channel.done(gen)

    def _store_reply(self) -> None:
        """Cache the KV of the reply (it extends an exact prompt exactly); always free the sequence."""
        try:
            if self.valid > self.n:
                exact = self.valid if self.exact_upto >= self.n else self.exact_upto
                self._store(self.valid, exact, self.gen.token_ids[:self.valid - self.n])
        finally:
            self.kv.release()

    def _store(self, upto: int, exact_upto: int, extra_tokens: list[int] = ()) -> None:
        """Cache KV up to `upto`; a failure costs only later reuse (logged), never this request."""
        try:
            store(self.parts, self.request.prompt, self.kv, upto, exact_upto, extra_tokens)
        except Exception:  # noqa: BLE001 - the request goes on; only its reuse by a later request is lost
            log.warning("kvboost: storing KV in the cache failed; the request goes on uncached", exc_info=True)

    def fail(self, err: BaseException) -> None:
        """End the request with an error (the caller sees it raised), unless it was already answered."""
        if self._delivered:
            return
        self.finished = True
        self.kv.release()
        self._deliver_error(err)

    def _deliver_error(self, err: BaseException) -> None:
        self._delivered = True
        self.gen.finish_reason = "error"
        self.gen.total_s = time.perf_counter() - self.request.started
        try:
            self.request.on_done(self.gen)
        finally:
            self.request.channel.error(err)


def _remember_reply(parts: EngineParts, gen: Generation, text: TextAssembler) -> None:
    """Remember which ids produced the reply text, so the next turn re-uses them exactly."""
    if not gen.text or not parts.prompt_tokenizer.memo_entries:
        return
    ids = [t for t in gen.token_ids if t not in parts.eos_ids]
    if text.stopped_at is not None:
        ids = text.ids_for(gen.text)          # the tokens before the stop string, if they decode to the text
    if ids is None or text.decode(ids) != gen.text:
        return
    if text.skip_special_tokens and set(ids) & set(getattr(parts.tokenizer, "all_special_ids", ()) or ()):
        return      # the text dropped them: a prompt that carries this text must not bring them back
    parts.prompt_tokenizer.remember_reply(gen.text, ids)
