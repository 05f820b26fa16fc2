"""CPU tensors for KV on transparent huge pages (2 MB), where Linux offers them.

A decode step reads every key and value row of its context once per layer: at a real size that is
the largest read of the step (a 1.7B model at 4,096 tokens: 1.6 GB of float32 KV against 1 GB of
4-bit weights). On 4 KB pages every 4 KB of it is a TLB miss and a new start for the hardware
prefetcher (a 16-token block of one KV head is exactly one page). PyTorch's CPU allocator asks for
huge pages only when THP_MEM_ALLOC_ENABLE is set before its first allocation, and most machines run
THP in `madvise` mode, so KV buffers are private anonymous mappings advised MADV_HUGEPAGE, aligned to
2 MB. The native step of one row, 2 threads, both buffers in one process (`python -m
benchmarks.micro.kv_pages`, benchmarks/results/kv_pages.json): 1.7B shape 100.0 against 112.8 ms
per token at 4,096 tokens of context, 1.01-1.04x at 512-2,048 and on the default model.

Memory is still committed page by page on first write (in 2 MB steps); nothing else changes:
`empty` returns an ordinary tensor that keeps its mapping alive, and falls back to torch.empty
where the mapping or the advice is not available (not Linux, CUDA, pinned memory, small tensors)
or KVBOOST_HUGEPAGES=0.
"""
from __future__ import annotations

import mmap
import os

import torch

HUGE = 2 << 20                  # bytes per huge page (x86-64, arm64 with 4 KB base pages)
MIN_BYTES = HUGE                # smaller buffers take torch.empty
ENV = "KVBOOST_HUGEPAGES"


def available() -> bool:
    """Whether `empty` maps huge-page-advised memory here (Linux with MADV_HUGEPAGE, not turned off)."""
    return hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get(ENV, "1") != "0"


def empty(shape, dtype: torch.dtype, device="cpu", pin_memory: bool = False) -> torch.Tensor:
    """torch.empty(shape, dtype) on `device`; a CPU buffer of at least MIN_BYTES on 2 MB-aligned
    memory advised MADV_HUGEPAGE (module docstring)."""
    device = torch.device(device)
    size = torch.Size(shape)
    nbytes = size.numel() * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or pin_memory or nbytes < MIN_BYTES or not available():
        return torch.empty(size, dtype=dtype, device=device, pin_memory=pin_memory)
    try:
        region = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError):
        return torch.empty(size, dtype=dtype)
    whole = torch.frombuffer(region, dtype=torch.uint8)      # holds the mapping while it lives
    start = -whole.data_ptr() % HUGE
    return whole[start:start + nbytes].view(dtype).view(size)
