"""Working KV of one request as one contiguous buffer (the non-paged path).

Cached KV is copied in; new KV is written in place. Paged sequences (paged.py) offer the same
methods over the shared block pool.
"""
from __future__ import annotations

import torch

from .dense import attend_dense
from .element import load, store, value_dtype
from .geometry import KVGeometry


class SequenceKV:
    """KV buffer for one sequence, sized for prompt + new tokens up front (no regrowth).

    Layout `[2, layers, 1, kv_heads, capacity, row_width]` (kv/element.py); per layer the attention
    reads the view `[1, kv_heads, :length, row_width]` (float KV: without copying).
    """

    allocates = True            # giving KV to the cache copies it into new pool blocks

    def __init__(self, geometry: KVGeometry, capacity: int, device: torch.device, pool=None):
        g = geometry
        self.geometry = g
        self.capacity = capacity
        self.pool = pool
        self.data = torch.empty(2, g.num_layers, 1, g.kv_heads, capacity, g.row_width, dtype=g.dtype, device=device)
        self.device = self.data.device
        self._slots: torch.Tensor | None = None

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor, start: int) -> None:
        """Store new K/V `[1, kv_heads, n, head_dim]` at positions start..start+n."""
        end = start + keys.shape[2]
        self.data[0, layer, :, :, start:end] = store(keys, self.data.dtype)
        self.data[1, layer, :, :, start:end] = store(values, self.data.dtype)

    def write_at(self, layer: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        self.data[0, layer, :, :, positions] = store(keys, self.data.dtype)
        self.data[1, layer, :, :, positions] = store(values, self.data.dtype)

    def gather(self, layer: int, positions: torch.Tensor):
        """K and V at `positions` as values (int8 rows decoded): `[1, kv_heads, n, head_dim]` each."""
        dtype = value_dtype(self.data.dtype)
        return tuple(load(self.data[i, layer, :, :, positions], dtype) for i in (0, 1))

    def slot_view(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the buffer as [2, layers, kv_heads, capacity, row_width], slot of every position: itself),
        for code that reads and writes KV by slot (the native decode step)."""
        if self._slots is None:
            self._slots = torch.arange(self.capacity, device=self.device)
        return self.data[:, :, 0], self._slots

    def view(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V rows of positions 0..end as stored: `[1, kv_heads, end, row_width]` each, views."""
        return self.data[0, layer, :, :, :end], self.data[1, layer, :, :, :end]

    def attend(self, layer: int, query, mask, is_causal: bool, scaling: float, end: int, explicit_mask=None,
               q_range=None, window=None):
        keys, values = (load(part, query.dtype) for part in self.view(layer, end))   # kv_dtype: cast on read
        return attend_dense(query, keys, values, mask, is_causal, scaling)

    def load(self, kv: torch.Tensor, start: int) -> None:
        """Copy KV rows as stored `[2, layers, kv_heads, n, row_width]` in at `start`."""
        n = kv.shape[3]
        self.data[:, :, 0, :, start:start + n] = kv

    def export(self, start: int, end: int) -> torch.Tensor:
        """A compact copy of the stored rows `[2, layers, kv_heads, end-start, row_width]`."""
        return self.data[:, :, 0, :, start:end].clone()

    def cache_blocks(self, first_index: int, end: int) -> list[int]:
        """New pool blocks holding this sequence's KV for block indices first_index.. up to `end`."""
        b = self.pool.block_tokens
        blocks = self.pool.allocate(-(-end // b) - first_index)
        self.pool.write([None] * first_index + blocks, first_index * b, self.export(first_index * b, end))
        return blocks

    def release(self) -> None:
        """Nothing to give back: the buffer is freed with the object."""
