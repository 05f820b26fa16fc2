"""Perplexity on the fixed evaluation text: how much quality 4-bit quantization costs."""
from __future__ import annotations

import math

import torch

from .texts import evaluation_text


@torch.inference_mode()
def perplexity(model, tokenizer, *, window: int = 512, max_tokens: int = 2048) -> float:
    """exp(mean next-token NLL) over the evaluation text, in non-overlapping windows."""
    ids = tokenizer(evaluation_text())["input_ids"][:max_tokens]
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = torch.tensor([ids[start:start + window]])
        if chunk.shape[1] < 2:
            break
        logits = model(chunk).logits.float()                        # [1, S, vocab]
        loss = torch.nn.functional.cross_entropy(logits[0, :-1], chunk[0, 1:], reduction="sum")
        nll += loss.item()
        count += chunk.shape[1] - 1
    return math.exp(nll / count)
