"""Which decoder layers stay resident, and where the others' weights are packed.

A streamed layer's quantized tensors live in one contiguous blob (64-byte aligned pieces);
the same blob layout is used on the backing tier and in a staging slot, so bringing a
layer in is one read or one copy, and binding it is creating views.
"""
from __future__ import annotations

import torch

from ..errors import BudgetError, InputError

ALIGN = 64


def _align(offset: int) -> int:
    return (offset + ALIGN - 1) // ALIGN * ALIGN


class LayerBinding:
    """Where each quantized tensor of one decoder layer sits in the layer's blob."""

    def __init__(self, modules: list):
        self.placed = []                    # (module, TensorSpec, byte offset)
        offset = 0
        for module in modules:
            for spec in module.specs():
                offset = _align(offset)
                self.placed.append((module, spec, offset))
                offset += spec.nbytes
        self.nbytes = _align(offset)

    def pack(self, tensors: list[dict[str, torch.Tensor]], out: torch.Tensor | None = None) -> torch.Tensor:
        """One uint8 blob [nbytes] from each module's layout tensors (in module order)."""
        blob = torch.zeros(self.nbytes, dtype=torch.uint8) if out is None else out
        by_module = {id(m): t for m, t in zip(self._modules(), tensors)}
        for module, spec, offset in self.placed:
            src = by_module[id(module)][spec.name]
            assert tuple(src.shape) == spec.shape and src.dtype == spec.dtype, (spec, src.shape, src.dtype)
            blob[offset:offset + spec.nbytes] = src.contiguous().view(-1).view(torch.uint8)
        return blob

    def bind(self, blob: torch.Tensor) -> None:
        """Point every module's tensors at views of `blob` (uint8, at least nbytes long)."""
        views: dict[int, dict[str, torch.Tensor]] = {}
        for module, spec, offset in self.placed:
            piece = blob[offset:offset + spec.nbytes].view(spec.dtype).view(spec.shape)
            views.setdefault(id(module), {})[spec.name] = piece
        for module in self._modules():
            module.tensors = views[id(module)]

    def unbind(self) -> None:
        for module in self._modules():
            module.tensors = None

    def _modules(self) -> list:
        seen: dict[int, object] = {}
        for module, _, _ in self.placed:
            seen.setdefault(id(module), module)
        return list(seen.values())


def resident_layers_set(num_layers: int, resident_layers: int | None = None, *,
                        layer_bytes: list[int] | None = None, resident_bytes: int | None = None,
                        staging_slots: int = 2) -> frozenset[int]:
    """The resident decoder layers: all (None), k split first/last, or what a byte budget holds.

    `resident_layers=k` keeps the first ceil(k/2) and the last floor(k/2) layers. With
    `resident_bytes`, the budget covers resident layers plus the staging slots, and as many
    layers as fit are kept (again split first/last).
    """
    if resident_layers is not None and resident_bytes is not None:
        raise InputError("pass resident_layers or resident_bytes, not both")
    if resident_bytes is not None:
        resident_layers = _layers_within(resident_bytes, layer_bytes or [], staging_slots)
    if resident_layers is None:
        return frozenset(range(num_layers))
    if isinstance(resident_layers, bool) or not isinstance(resident_layers, int) or resident_layers < 0:
        raise InputError(f"resident_layers must be None or an int >= 0, got {resident_layers!r}")
    k = min(resident_layers, num_layers)
    first = (k + 1) // 2
    return frozenset(range(first)) | frozenset(range(num_layers - (k - first), num_layers))


def _layers_within(budget: int, layer_bytes: list[int], staging_slots: int) -> int:
    staging = staging_slots * max(layer_bytes, default=0)
    if budget < staging:
        raise BudgetError(f"resident_bytes={budget} cannot hold the {staging_slots} staging slots "
                          f"({staging} bytes); raise the budget or lower staging_slots")
    n = len(layer_bytes)
    for k in range(n, -1, -1):
        chosen = resident_layers_set(n, k)
        if staging * (k < n) + sum(layer_bytes[i] for i in chosen) <= budget:
            return k
    return 0
