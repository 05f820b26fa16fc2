"""One request, start to end: lookup -> load reused KV -> prefill -> decode -> store.

Written once as a generator of text deltas; non-streaming calls aggregate it.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Generator
from dataclasses import dataclass

import torch

from .arch import ModelAdapter
from .cache import ChunkCache
from .detok import TextAssembler
from .errors import ContextWindowError
from .forward import Forward
from .generation import Generation
from .kv import SequenceKV
from .sampling import Sampler, SamplingParams
from .tokens import PromptTokenizer, TokenizedPrompt


@dataclass(slots=True)
class EngineParts:
    """What a request needs from the engine (no back-reference to the engine itself)."""

    adapter: ModelAdapter
    forward: Forward
    cache: ChunkCache
    prompt_tokenizer: PromptTokenizer
    tokenizer: object
    eos_ids: frozenset
    compute_lock: threading.Lock
    chunk_tokens: int

    def compute(self, kv: SequenceKV, token_ids: list[int], start: int) -> torch.Tensor:
        with self.compute_lock:
            return self.forward(kv, token_ids, start)


def check_window(parts: EngineParts, prompt_tokens: int, max_new_tokens: int) -> None:
    window = parts.adapter.context_window
    if prompt_tokens + max_new_tokens > window:
        raise ContextWindowError(
            f"prompt has {prompt_tokens} tokens and max_new_tokens is {max_new_tokens}: together "
            f"{prompt_tokens + max_new_tokens}, beyond the model's context window of {window} tokens"
        )


def load_reused(parts: EngineParts, prompt: TokenizedPrompt, kv: SequenceKV) -> int:
    """Copy the longest cached prefix (all but the last prompt token) into `kv`; return its length."""
    match = parts.cache.match(prompt.token_ids, limit=len(prompt) - 1)
    for chunk_kv, start, used in match.spans:
        kv.load_chunk(chunk_kv[:, :, :, :used], start)
    return match.tokens


def store(parts: EngineParts, token_ids: list[int], chunk_ends: list[int], kv: SequenceKV, upto: int,
          *, pin: bool = False) -> int:
    return parts.cache.insert(token_ids, chunk_ends, upto, kv.export, pin=pin)


def run_request(parts: EngineParts, prompt: TokenizedPrompt, params: SamplingParams,
                cancel: threading.Event) -> Generator[str, None, Generation]:
    started = time.perf_counter()
    n = len(prompt)
    kv = SequenceKV(parts.adapter.geometry, n + params.max_new_tokens, parts.adapter.device)
    reused = load_reused(parts, prompt, kv)
    gen = Generation(prompt_tokens=n, reused_tokens=reused, reused_exact=reused, recomputed=n - reused)
    sampler = Sampler(params, parts.adapter.device)
    text = TextAssembler(parts.tokenizer, params.stop)
    valid = reused                                  # positions whose KV is computed and correct
    try:
        logits = parts.compute(kv, prompt.token_ids[reused:], reused)
        valid = n
        token = sampler(logits)
        gen.ttft_s = time.perf_counter() - started
        store(parts, prompt.token_ids, prompt.chunk_ends, kv, n)
        gen.finish_reason = "length"
        while True:
            gen.token_ids.append(token)
            if token in parts.eos_ids and not params.ignore_eos:
                gen.finish_reason = "stop"
                break
            delta = text.add(token)
            if delta:
                yield delta
            if text.stopped_at is not None:
                gen.finish_reason = "stop"
                break
            if len(gen.token_ids) >= params.max_new_tokens:
                break
            if cancel.is_set():
                gen.finish_reason = "cancelled"
                break
            logits = parts.compute(kv, [token], valid)
            valid += 1
            token = sampler(logits)
        tail = text.finish()
        if tail:
            yield tail
    except GeneratorExit:
        gen.finish_reason = "cancelled"
        raise
    finally:
        _store_generated(parts, prompt, gen, kv, valid)
    gen.text = text.final_text
    _remember_reply(parts, gen, text)
    gen.total_s = time.perf_counter() - started
    return gen


def _store_generated(parts: EngineParts, prompt: TokenizedPrompt, gen: Generation, kv: SequenceKV,
                     valid: int) -> None:
    n = len(prompt)
    if valid <= n:
        return
    tokens = prompt.token_ids + gen.token_ids[:valid - n]
    ends = prompt.chunk_ends + list(range(n + parts.chunk_tokens, valid, parts.chunk_tokens)) + [valid]
    store(parts, tokens, ends, kv, valid)


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
