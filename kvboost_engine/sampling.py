"""Sampling parameters (validated) and the token sampler."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import InputError


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. temperature 0 is greedy; ignore_eos (for
    benchmarks) keeps decoding past EOS until max_new_tokens or a stop string; keep_first_logits
    puts the logits the first token was sampled from on `Generation.first_logits`."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    keep_first_logits: bool = False

    @classmethod
    def build(cls, max_new_tokens=256, temperature=0.0, top_p=1.0, top_k=0, stop=None, seed=None,
              ignore_eos=False, keep_first_logits=False) -> "SamplingParams":
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        if not isinstance(temperature, (int, float)) or temperature < 0:
            raise InputError(f"temperature must be a number >= 0, got {temperature!r}")
        if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
            raise InputError(f"top_p must be in (0, 1], got {top_p!r}")
        if top_k is None:
            top_k = 0
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise InputError(f"top_k must be an int >= 0 (0 = off), got {top_k!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise InputError(f"seed must be an int or None, got {seed!r}")
        return cls(max_new_tokens, float(temperature), float(top_p), top_k, _stops(stop), seed, bool(ignore_eos),
                   bool(keep_first_logits))


def _stops(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    stops = tuple(stop)
    if not all(isinstance(s, str) for s in stops):
        raise InputError(f"stop must be a string or a list of strings, got {stop!r}")
    return tuple(s for s in stops if s)


class Sampler:
    """Greedy argmax, or temperature / top-k / top-p sampling from a seeded generator."""

    def __init__(self, params: SamplingParams, device: torch.device):
        self.params = params
        self.generator = None
        if params.temperature > 0:
            self.generator = torch.Generator(device=device)
            if params.seed is not None:
                self.generator.manual_seed(params.seed)
            else:
                self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        # logits: [vocab] fp32
        p = self.params
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
