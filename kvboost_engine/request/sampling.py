"""Sampling parameters (validated) and the token sampler."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import InputError


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. temperature 0 is greedy; `min_new_tokens` keeps the
    end-of-sequence tokens out of reach until that many tokens were generated (as in
    transformers' `generate`). `skip_special_tokens=False` keeps special tokens other than the
    one that ends the reply in the text (a tool-call marker such as `[TOOL_CALLS]`)."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    min_new_tokens: int = 0
    skip_special_tokens: bool = True

    @classmethod
    def build(cls, max_new_tokens=256, temperature=0.0, top_p=1.0, top_k=0, stop=None, seed=None,
              min_new_tokens=0, skip_special_tokens=True) -> "SamplingParams":
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        if not _real(temperature) or not 0 <= temperature < math.inf:
            raise InputError(f"temperature must be a finite number >= 0, got {temperature!r}")
        if not _real(top_p) or not 0 < top_p <= 1:
            raise InputError(f"top_p must be in (0, 1], got {top_p!r}")
        if top_k is None:
            top_k = 0
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise InputError(f"top_k must be an int >= 0 (0 = off), got {top_k!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64):
            raise InputError(f"seed must be None or an int in [0, 2**64), got {seed!r}")
        if isinstance(min_new_tokens, bool) or not isinstance(min_new_tokens, int) or min_new_tokens < 0:
            raise InputError(f"min_new_tokens must be an int >= 0, got {min_new_tokens!r}")
        if not isinstance(skip_special_tokens, bool):
            raise InputError(f"skip_special_tokens must be a bool, got {skip_special_tokens!r}")
        return cls(max_new_tokens, float(temperature), float(top_p), top_k, _stops(stop), seed,
                   min(min_new_tokens, max_new_tokens), skip_special_tokens)


def _real(value) -> bool:
    """A real number (not a bool, not NaN)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _stops(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)):
        raise InputError(f"stop must be a string or a list of strings, got {stop!r}")
    stops = tuple(stop)
    if not all(isinstance(s, str) for s in stops):
        raise InputError(f"stop must be a string or a list of strings, got {stop!r}")
    return tuple(s for s in stops if s)


class Sampler:
    """Greedy argmax, or temperature / top-k / top-p sampling from a seeded generator."""

    def __init__(self, params: SamplingParams, device: torch.device, eos_ids=frozenset()):
        self.params = params
        self.eos_ids = sorted(eos_ids)
        self.generator = None
        if params.temperature > 0:
            self.generator = torch.Generator(device=device)
            if params.seed is not None:
                self.generator.manual_seed(params.seed)
            else:
                self.generator.seed()

    def __call__(self, logits: torch.Tensor, generated: int = 0) -> int:
        """The next token from logits [vocab] (fp32), `generated` tokens into the reply."""
        p = self.params
        if generated < p.min_new_tokens and self.eos_ids:
            logits = logits.clone()
            logits[self.eos_ids] = float("-inf")
        if p.temperature == 0:
            return int(torch.argmax(logits))
        logits = logits / p.temperature
        if p.top_k and p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cumulative = torch.cumsum(sorted_probs, dim=-1)
            drop = cumulative - sorted_probs >= p.top_p     # keep the smallest set reaching top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self.generator))
