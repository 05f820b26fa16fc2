"""The shape of a model's KV cache (no transformers here: the model adapter builds it)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True, frozen=True)
class KVGeometry:
    """Shape of the KV cache of one model: per token, `num_layers x 2 x kv_heads x head_dim`."""

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.kv_heads * self.head_dim * elem
