"""The shape of a model's KV cache (no transformers here: the model adapter builds it)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .element import row_width, unsupported


@dataclass(slots=True, frozen=True)
class KVGeometry:
    """Shape of the KV cache of one model: per token, `num_layers x 2 x kv_heads x head_dim` values,
    stored as rows of `row_width` elements of `dtype` (kv/element.py).

    Sliding-window layers keep every position too (a cached prefix can be continued from any
    point, and a window layer needs the window before wherever it continues), so every layer has
    the same shape and bytes per token; the window is applied by the attention mask.
    """

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def row_width(self) -> int:
        """Stored elements per row of head_dim values (kv/element.py: int8 rows carry their scales)."""
        return row_width(self.head_dim, self.dtype)

    def unsupported(self) -> str | None:
        """Why rows of head_dim values cannot be stored as `dtype` (None: they can)."""
        return unsupported(self.head_dim, self.dtype)

    @property
    def bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.kv_heads * self.row_width * elem
