"""Sampling parameters (validated) and the token sampler."""
from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..errors import InputError
from .penalties import Penalties


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. temperature 0 is greedy; `min_new_tokens` keeps the
    end-of-sequence tokens out of reach until that many tokens were generated (as in
    transformers' `generate`). `skip_special_tokens=False` keeps special tokens other than the
    one that ends the reply in the text (a tool-call marker such as `[TOOL_CALLS]`).

    Logits processors (all off by default), applied in this order before temperature, top-k and
    top-p: `logit_bias` ({token id: bias in [-100, 100]}, added to the logits, as OpenAI's);
    `repetition_penalty` (> 0; 1 is off; transformers' definition: a logit of a token seen in the
    prompt or the reply is divided by it when positive, multiplied when negative);
    `presence_penalty` and `frequency_penalty` (in [-2, 2]; OpenAI's definition: subtract
    presence * [count > 0] + frequency * count, counted over the reply's tokens only).
    `logprobs=True` records each generated token's log-probability under the processed logits
    (after the processors and a constraint, before temperature / top-k / top-p) with its
    `top_logprobs` (0 to 20) best alternatives.
    """

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    min_new_tokens: int = 0
    skip_special_tokens: bool = True
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0

    def check_vocabulary(self, vocab_size: int) -> None:
        """InputError if logit_bias names a token the model does not have."""
        if self.logit_bias and self.logit_bias[-1][0] >= vocab_size:
            raise InputError(f"logit_bias names token {self.logit_bias[-1][0]}, beyond this model's {vocab_size} tokens")

    @property
    def adjusts_logits(self) -> bool:
        """Whether any logits processor (bias or penalty) is on."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or bool(self.logit_bias))

    @classmethod
    def build(cls, max_new_tokens=256, temperature=0.0, top_p=1.0, top_k=0, stop=None, seed=None,
              min_new_tokens=0, skip_special_tokens=True, repetition_penalty=1.0, presence_penalty=0.0,
              frequency_penalty=0.0, logit_bias=None, logprobs=False, top_logprobs=0) -> "SamplingParams":
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
        processing = _processing(repetition_penalty, presence_penalty, frequency_penalty, logit_bias, logprobs,
                                 top_logprobs)
        return cls(max_new_tokens, float(temperature), float(top_p), top_k, stop_strings(stop), seed,
                   min(min_new_tokens, max_new_tokens), skip_special_tokens, **processing)


def _processing(repetition_penalty, presence_penalty, frequency_penalty, logit_bias, logprobs, top_logprobs) -> dict:
    """The logits processors' and logprobs' parameters, validated."""
    if not _real(repetition_penalty) or not 0 < repetition_penalty < math.inf:
        raise InputError(f"repetition_penalty must be a finite number > 0 (1 = off), got {repetition_penalty!r}")
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if not _real(value) or not -2 <= value <= 2:
            raise InputError(f"{name} must be a number in [-2, 2] (0 = off), got {value!r}")
    if not isinstance(logprobs, bool):
        raise InputError(f"logprobs must be a bool, got {logprobs!r}")
    if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int) or not 0 <= top_logprobs <= 20:
        raise InputError(f"top_logprobs must be an int in [0, 20], got {top_logprobs!r}")
    if top_logprobs and not logprobs:
        raise InputError("top_logprobs needs logprobs=True")
    return dict(repetition_penalty=float(repetition_penalty), presence_penalty=float(presence_penalty),
                frequency_penalty=float(frequency_penalty), logit_bias=_bias(logit_bias), logprobs=logprobs,
                top_logprobs=top_logprobs)


def _bias(logit_bias) -> tuple[tuple[int, float], ...]:
    """{token id (an int, or its digits as OpenAI's JSON keys are): bias in [-100, 100]} as sorted pairs."""
    if logit_bias is None:
        return ()
    if not isinstance(logit_bias, Mapping):
        raise InputError(f"logit_bias must be a dict {{token id: bias}}, got {type(logit_bias).__name__}")
    pairs = {}
    for key, bias in logit_bias.items():
        token = int(key) if isinstance(key, str) and key.isdigit() else key
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise InputError(f"logit_bias keys must be token ids (ints >= 0), got {key!r}")
        if not _real(bias) or not -100 <= bias <= 100:
            raise InputError(f"logit_bias values must be numbers in [-100, 100], got {bias!r} for token {key!r}")
        pairs[token] = float(bias)
    return tuple(sorted(pairs.items()))


def _real(value) -> bool:
    """A real number (not a bool, not NaN)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def stop_strings(stop) -> tuple[str, ...]:
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
    """Greedy argmax, or temperature / top-k / top-p sampling from a seeded generator, after the
    request's logits processors (min_new_tokens, bias, penalties over `prompt_ids` and the reply).

    `sampler(logits, generated)` is `adjust`, `pick`, `accept` in one; a caller that needs the
    processed logits (logprobs, a constraint check) runs the three itself."""

    def __init__(self, params: SamplingParams, device: torch.device, eos_ids=frozenset(), prompt_ids=()):
        self.params = params
        self.eos_ids = sorted(eos_ids)
        self.penalties = Penalties(params, prompt_ids) if params.adjusts_logits else None
        self.generator = None
        if params.temperature > 0:
            self.generator = torch.Generator(device=device)
            if params.seed is not None:
                self.generator.manual_seed(params.seed)
            else:
                self.generator.seed()

    def __call__(self, logits: torch.Tensor, generated: int = 0) -> int:
        """The next token from logits [vocab] (fp32), `generated` tokens into the reply."""
        token = self.pick(self.adjust(logits, generated))
        self.accept(token)
        return token

    def greedy(self, logits: torch.Tensor, generated: int = 0) -> int | None:
        """The greedy token without copying the logits, when no processor but min_new_tokens applies
        (the hot path of a batched step); None where `adjust` and `pick` must run. The same token as
        they give: an argmax that is not an end-of-sequence token is also the first maximum once
        those are masked (an earlier end token equal to it would have been the argmax)."""
        if self.params.temperature != 0 or self.penalties is not None:
            return None
        token = argmax(logits)
        if generated < self.params.min_new_tokens and token in self.eos_ids:
            return None
        return token

    def adjust(self, logits: torch.Tensor, generated: int = 0) -> torch.Tensor:
        """The logits after the processors (a new tensor where any applies; the input is not changed)."""
        if generated < self.params.min_new_tokens and self.eos_ids:
            logits = logits.clone()
            logits[self.eos_ids] = float("-inf")
        if self.penalties is not None:
            logits = self.penalties.apply(logits)
        return logits

    def accept(self, token: int) -> None:
        """`token` joins the reply (the penalties count it)."""
        if self.penalties is not None:
            self.penalties.accept(token)

    def pick(self, logits: torch.Tensor) -> int:
        """Greedy, or a draw after temperature, top-k and top-p, from processed logits [vocab]."""
        p = self.params
        if p.temperature == 0:
            return argmax(logits)
        top = float(logits.max())
        if top == float("-inf"):
            raise InputError("no token can be chosen here: every logit is -inf (a grammar that cannot continue, "
                             "or logit_bias masking every token)")
        if top == float("inf"):
            return argmax(logits)       # a logit_bias of +inf: that token
        # scaled from the top (the same distribution): the top stays 0 however small the temperature, the
        # others go to -inf, its limit; scaled as they were, negative logits overflowed to -inf, all of them
        logits = (logits - top) / p.temperature
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


def argmax(logits: torch.Tensor) -> int:
    """The index of the first largest logit (a NaN counts as largest), as torch.argmax gives it: through
    NumPy for CPU float32 logits (3 us over a 49k vocabulary against torch.argmax's 44 us on 2 cores,
    once per sequence and token), torch.argmax for the rest."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        return int(logits.numpy().argmax())
    return int(torch.argmax(logits))


SAMPLING_NAMES = frozenset(inspect.signature(SamplingParams.build).parameters) - {"cls"}


def check_names(params: dict) -> dict:
    """`params` as they are if SamplingParams.build takes every name (what a request sets besides its
    constraint and timeout_s); else an InputError naming the unknown ones and the accepted ones."""
    unknown = sorted(set(params) - SAMPLING_NAMES)
    if unknown:
        hint = " (max_new_tokens is this engine's name for max_tokens)" if "max_tokens" in unknown else ""
        raise InputError(f"unknown request parameters {unknown}{hint}; accepted: constraint, timeout_s, "
                         f"{', '.join(sorted(SAMPLING_NAMES))}")
    return params
