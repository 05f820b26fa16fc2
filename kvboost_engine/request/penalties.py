"""One request's logits processors: logit_bias and the repetition, presence and frequency penalties.

Counts live in tensors over the vocabulary, updated by one index per generated token, so a step
costs a few vector operations whatever the reply's length.
"""
from __future__ import annotations

import torch


class Penalties:
    """logit_bias (added), repetition_penalty (transformers: over the prompt and the reply) and
    presence / frequency penalties (OpenAI: over the reply only) of one request."""

    def __init__(self, params, prompt_ids=()):
        self.params = params
        self._prompt_ids = list(prompt_ids)
        self._counts: torch.Tensor | None = None       # [vocab] times each token was generated
        self._seen: torch.Tensor | None = None         # [vocab] in the prompt or the reply
        self._bias: torch.Tensor | None = None         # [vocab]

    def _start(self, logits: torch.Tensor) -> None:
        vocab, device = logits.shape[-1], logits.device
        self._counts = torch.zeros(vocab, dtype=torch.float32, device=device)
        self._seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        ids = [t for t in self._prompt_ids if 0 <= t < vocab]
        if ids:
            self._seen[torch.tensor(ids, device=device)] = True
        if self.params.logit_bias:
            self._bias = torch.zeros(vocab, dtype=torch.float32, device=device)
            tokens, biases = zip(*self.params.logit_bias)
            self._bias[torch.tensor(tokens, device=device)] = torch.tensor(biases, device=device)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Processed logits [vocab] (a new tensor)."""
        if self._counts is None:
            self._start(logits)
        p = self.params
        logits = logits.float()
        if self._bias is not None:
            logits = logits + self._bias
        if p.repetition_penalty != 1.0:
            penalized = torch.where(logits < 0, logits * p.repetition_penalty, logits / p.repetition_penalty)
            logits = torch.where(self._seen, penalized, logits)
        if p.frequency_penalty != 0.0:
            logits = logits - self._counts * p.frequency_penalty
        if p.presence_penalty != 0.0:
            logits = logits - (self._counts > 0).float() * p.presence_penalty
        return logits

    def accept(self, token: int) -> None:
        """Count a generated token."""
        if self._counts is not None and 0 <= token < self._counts.shape[0]:
            self._counts[token] += 1
            self._seen[token] = True
