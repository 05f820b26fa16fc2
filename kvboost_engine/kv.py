"""Working KV of one request: a preallocated contiguous buffer per layer."""
from __future__ import annotations

import torch

from .arch import KVGeometry


class SequenceKV:
    """KV buffer for one sequence, sized for prompt + new tokens up front (no regrowth).

    Layout `[2, layers, 1, kv_heads, capacity, head_dim]`; per layer the attention reads
    the view `[1, kv_heads, :length, head_dim]` without copying.
    """

    def __init__(self, geometry: KVGeometry, capacity: int, device: torch.device):
        g = geometry
        self.geometry = g
        self.capacity = capacity
        self.data = torch.empty(2, g.num_layers, 1, g.kv_heads, capacity, g.head_dim, dtype=g.dtype, device=device)

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor, start: int) -> None:
        """Store new K/V `[1, kv_heads, n, head_dim]` at positions start..start+n."""
        end = start + keys.shape[2]
        self.data[0, layer, :, :, start:end] = keys
        self.data[1, layer, :, :, start:end] = values

    def view(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions 0..end: `[1, kv_heads, end, head_dim]` each, views."""
        return self.data[0, layer, :, :, :end], self.data[1, layer, :, :, :end]

    def load_chunk(self, chunk_kv: torch.Tensor, start: int) -> None:
        """Copy a stored chunk `[2, layers, kv_heads, n, head_dim]` in at `start`."""
        n = chunk_kv.shape[3]
        self.data[:, :, 0, :, start:start + n] = chunk_kv

    def export(self, start: int, end: int) -> torch.Tensor:
        """A compact copy `[2, layers, kv_heads, end-start, head_dim]` for the chunk cache."""
        return self.data[:, :, 0, :, start:end].clone()
