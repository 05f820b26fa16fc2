"""A linear layer whose weight is 4-bit AWQ, held in a compute layout's tensors.

The tensors are plain attributes, not parameters: layer streaming binds them to views of
a staging slot just before the layer runs and unbinds them after.
"""
from __future__ import annotations

import torch
from torch import nn


class AWQLinear(nn.Module):
    """Drop-in for nn.Linear with AWQ 4-bit weights; `tensors` is None while unbound (streamed out)."""

    def __init__(self, in_features: int, out_features: int, group_size: int, layout, bias: bool,
                 device=None, dtype=None, checkpoint_name: str = ""):
        super().__init__()
        self.checkpoint_name = checkpoint_name          # prefix of its qweight/qzeros/scales
        self.in_features = in_features
        self.out_features = out_features
        self.group_size = group_size
        self.layout = layout
        self.tensors: dict[str, torch.Tensor] | None = None
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype), requires_grad=False) \
            if bias else None

    def specs(self):
        """The layout's tensor specs for this layer's shape."""
        return self.layout.specs(self.in_features, self.out_features, self.group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tensors is None:
            raise RuntimeError("AWQLinear ran while its weights were streamed out (missing before_layer)")
        lead = x.shape[:-1]
        out = self.layout.matmul(x.reshape(-1, self.in_features), self.tensors, self.group_size)   # [M, N]
        out = out.reshape(*lead, self.out_features)
        return out + self.bias if self.bias is not None else out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group_size={self.group_size}, layout={self.layout.name}, bound={self.tensors is not None}")
