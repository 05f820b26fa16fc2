"""One request, start to end: lookup -> load reused KV -> prefill -> decode -> store.

Written once as a generator of text deltas; non-streaming calls aggregate it.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass

from ..errors import ContextWindowError, InputError
from ..instrument import FirstTokenEvent, Instruments
from ..model.arch import ModelAdapter
from .detok import TextAssembler
from .generation import Generation
from .prefill import Prefilled, PrefillParts, prefill
from .sampling import Sampler, SamplingParams
from .tokens import PromptTokenizer, TokenizedPrompt


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


def check_window(parts: EngineParts, prompt_tokens: int, max_new_tokens: int) -> None:
    window = parts.adapter.context_window
    if prompt_tokens + max_new_tokens > window:
        raise ContextWindowError(
            f"prompt has {prompt_tokens} tokens and max_new_tokens is {max_new_tokens}: together "
            f"{prompt_tokens + max_new_tokens}, beyond the model's context window of {window} tokens"
        )


def store(parts: EngineParts, prompt: TokenizedPrompt, kv, upto: int, exact_upto: int,
          extra_tokens: list[int] = (), *, pin: bool = False) -> int:
    """Insert the KV of the prompt (plus `extra_tokens` generated after it) into the cache."""
    n = len(prompt)
    chunk = parts.prefill.config.chunk_tokens
    tokens = prompt.token_ids + list(extra_tokens)
    ends = prompt.chunk_ends + list(range(n + chunk, upto, chunk)) + ([upto] if upto > n else [])
    kinds = prompt.chunk_kinds + ["generated"] * (len(ends) - len(prompt.chunk_ends))
    indexed = parts.prefill.config.moved_reuse != "full"      # the content index serves moved reuse only
    return parts.prefill.cache.insert(tokens, ends, upto, kv, pin=pin, exact_upto=exact_upto,
                                      chunk_kinds=kinds if indexed else None)


def prefill_prompt(parts: EngineParts, prompt: TokenizedPrompt, new_tokens: int) -> Prefilled:
    return prefill(parts.prefill, prompt, new_tokens)


def run_request(parts: EngineParts, prompt: TokenizedPrompt, params: SamplingParams, cancel: threading.Event,
                on_done: Callable[[Generation], None] = lambda gen: None,
                constraint=None) -> Generator[str, None, Generation]:
    """Text deltas of one request; returns its Generation. `on_done(gen)` runs however the request
    ends (finished, cancelled, closed early, failed), once."""
    started = time.perf_counter()
    gen = Generation(prompt_tokens=len(prompt))
    try:
        done = prefill_prompt(parts, prompt, params.max_new_tokens)
        yield from _decode(parts, prompt, params, cancel, constraint, done, gen, started)
    except GeneratorExit:
        gen.finish_reason = "cancelled"
        raise
    except BaseException:
        gen.finish_reason = gen.finish_reason or "error"
        raise
    finally:
        gen.total_s = time.perf_counter() - started
        on_done(gen)
    return gen


def _decode(parts: EngineParts, prompt: TokenizedPrompt, params: SamplingParams, cancel: threading.Event,
            constraint, done: Prefilled, gen: Generation, started: float) -> Generator[str, None, None]:
    n = len(prompt)
    sampler = Sampler(params, parts.adapter.device, parts.eos_ids)
    text = TextAssembler(parts.tokenizer, params.stop, params.skip_special_tokens)
    kv = done.sequence
    valid, exact_upto = n, done.exact_upto          # KV positions computed / equal to a full prefill
    try:
        gen.reused_exact, gen.reused_moved = done.reused_exact, done.reused_moved
        gen.reused_tokens = done.reused_exact + done.reused_moved
        gen.recomputed = done.recomputed
        token = _next_token(sampler, done.logits, constraint, 0)
        gen.ttft_s = time.perf_counter() - started
        if parts.instruments.active:
            parts.instruments.emit(FirstTokenEvent(done.logits, n))
        store(parts, prompt, kv, n, exact_upto)
        gen.finish_reason = "length"
        while True:
            gen.token_ids.append(token)
            if token in parts.eos_ids:
                gen.finish_reason = "stop"
                break
            delta = text.add(token)
            if delta:
                yield delta
            if text.stopped_at is not None or (constraint is not None and constraint.is_finished()):
                gen.finish_reason = "stop"
                break
            if len(gen.token_ids) >= params.max_new_tokens:
                break
            if cancel.is_set():
                gen.finish_reason = "cancelled"
                break
            logits = parts.prefill.runner.forward(kv, [token], valid, "decode")
            valid += 1
            token = _next_token(sampler, logits, constraint, len(gen.token_ids))
        tail = text.finish()
        if tail:
            yield tail
    finally:
        try:
            if valid > n:       # decode KV of the reply extends an exact prompt exactly
                store(parts, prompt, kv, valid, valid if exact_upto >= n else exact_upto, gen.token_ids[:valid - n])
        finally:
            kv.release()
    gen.text = text.final_text
    _remember_reply(parts, gen, text)


def _next_token(sampler: Sampler, logits, constraint, generated: int) -> int:
    if constraint is not None:
        logits = constraint.mask(logits)
    token = sampler(logits, generated)
    if constraint is not None:
        if logits[token] == float("-inf"):
            raise InputError("the constraint allows no token here (its grammar cannot continue)")
        constraint.advance(token)
    return token


def _remember_reply(parts: EngineParts, gen: Generation, text: TextAssembler) -> None:
    """Remember which ids produced the reply text, so the next turn re-uses them exactly."""
    ids = [t for t in gen.token_ids if t not in parts.eos_ids]
    if not gen.text:
        return
    if text.stopped_at is not None:
        ids = next((ids[:k] for k in range(1, len(ids) + 1) if text.decode(ids[:k]) == gen.text), None)
    if ids is None or text.decode(ids) != gen.text:
        return
    parts.prompt_tokenizer.remember_reply(gen.text, ids)
