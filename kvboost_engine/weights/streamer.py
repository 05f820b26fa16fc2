"""Layer streaming: non-resident decoder layers are brought in just before they run.

A fixed number of staging slots hold streamed layers. While layer i computes from one slot,
a worker thread fills the next slot with the next streamed layer (cyclically, so the first
streamed layer of the next forward is fetched during the last ones of this forward). On CUDA
the worker reads into a pinned staging buffer and copies on a separate stream; events order
the copy after the slot's previous user and the layer's kernels after the copy.

The hooks are PyTorch forward pre/post hooks on the decoder layer modules, so every forward
that runs the layers (kvboost's own loop, or a plain HF forward) streams correctly.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .memory import peak_rss_bytes
from .residency import LayerBinding
from .tiers import fill


@dataclass(slots=True)
class StreamStats:
    """Counters since load (or the last reset) over layers brought in and used: loads, bytes,
    prefetch hits (the load had finished when the layer was needed), time spent waiting.
    Loads dropped by a resynchronisation are counted in `discarded`."""

    loads: int = 0
    bytes: int = 0
    hits: int = 0
    waits: int = 0
    wait_s: float = 0.0
    passes: int = 0
    resyncs: int = 0
    discarded: int = 0

    def as_dict(self) -> dict:
        used = self.hits + self.waits
        return {"stream_loads": self.loads, "stream_bytes": self.bytes, "prefetch_hits": self.hits,
                "prefetch_hit_rate": self.hits / used if used else None, "stream_wait_s": self.wait_s,
                "stream_passes": self.passes,
                "stream_bytes_per_pass": self.bytes / self.passes if self.passes else None,
                "stream_resyncs": self.resyncs, "stream_discarded_loads": self.discarded}


class _Slot:
    """One staging slot: a device buffer, plus (CUDA) pinned staging and ordering events."""

    def __init__(self, nbytes: int, device: torch.device):
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.cuda = device.type == "cuda"
        self.staging = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) if self.cuda else self.buffer
        self.ready = torch.cuda.Event() if self.cuda else None     # copy into buffer finished
        self.free = torch.cuda.Event() if self.cuda else None      # last reader of buffer finished


class LayerStreamer:
    """Brings streamed layers into staging slots ahead of use and binds them while they run."""

    def __init__(self, layers: list[torch.nn.Module], bindings: dict[int, LayerBinding], tier,
                 num_slots: int = 2, device: torch.device | str = "cpu"):
        if num_slots < 2:
            raise ValueError("layer streaming needs at least 2 staging slots")
        self.device = torch.device(device)
        self.bindings = bindings
        self.tier = tier
        self.order = sorted(bindings)
        self._position = {layer: p for p, layer in enumerate(self.order)}
        slot_bytes = max(b.nbytes for b in bindings.values())
        self.slots = [_Slot(slot_bytes, self.device) for _ in range(min(num_slots, len(self.order) + 1))]
        self.staging_bytes = slot_bytes * len(self.slots) * (2 if self.device.type == "cuda" else 1)
        self._free = deque(range(len(self.slots)))
        self._inflight: dict[int, tuple[int, Future]] = {}
        self._current: tuple[int, int] | None = None
        self._next = 0
        self._lock = threading.Lock()
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvboost-stream")
        self.stats = StreamStats()
        self._handles = []
        for index in self.order:
            self._handles.append(layers[index].register_forward_pre_hook(self._pre_hook(index)))
            self._handles.append(layers[index].register_forward_hook(self._post_hook(index)))
        with self._lock:
            self._top_up()

    # ---- hooks --------------------------------------------------------------------------
    def _pre_hook(self, index: int):
        return lambda module, args: self.before_layer(index)

    def _post_hook(self, index: int):
        return lambda module, args, output: self.after_layer(index)

    def before_layer(self, index: int) -> None:
        """Make streamed layer `index` resident in a slot (waiting for its load if needed)."""
        with self._lock:
            if self._current is not None:          # the previous layer raised before after_layer
                self._release_current()
            if index not in self._inflight:
                self._resync(index)
            slot_id, future = self._inflight.pop(index)
            slot = self.slots[slot_id]
            hit = future.done() and (slot.ready is None or slot.ready.query())
            started = time.perf_counter()
            try:
                future.result()
            except BaseException:                  # the load failed: its slot is free again, and the next
                self._free.append(slot_id)         # pass loads the layer afresh (_resync)
                raise
            self._count_use(index, hit, time.perf_counter() - started)
            if slot.ready is not None:
                torch.cuda.current_stream(self.device).wait_event(slot.ready)
            self.bindings[index].bind(slot.buffer)
            self._current = (index, slot_id)

    def after_layer(self, index: int) -> None:
        """Unbind layer `index`, give its slot back and start the next loads."""
        with self._lock:
            if self._current is None or self._current[0] != index:
                return
            self._release_current()
            self._top_up()

    # ---- scheduling ---------------------------------------------------------------------
    def _release_current(self) -> None:
        index, slot_id = self._current
        self.bindings[index].unbind()
        slot = self.slots[slot_id]
        if slot.free is not None:
            slot.free.record(torch.cuda.current_stream(self.device))
        self._free.append(slot_id)
        self._current = None

    def _top_up(self) -> None:
        """Fill free slots with the next streamed layers in cyclic order."""
        while self._free:
            index = self.order[self._next]
            if index in self._inflight or (self._current is not None and self._current[0] == index):
                return
            slot_id = self._free.popleft()
            self._inflight[index] = (slot_id, self._worker.submit(self._load, index, slot_id))
            self._next = (self._next + 1) % len(self.order)

    def _resync(self, index: int) -> None:
        """A layer ran out of the expected order: drop pending loads and restart from `index`."""
        self.stats.resyncs += 1
        self.stats.discarded += len(self._inflight)
        for slot_id, future in self._inflight.values():
            try:
                future.result()                    # dropped: a failed load is retried when its layer is asked for
            except Exception:
                pass
            self._free.append(slot_id)
        self._inflight.clear()
        self._next = self._position[index]
        self._top_up()

    def _load(self, index: int, slot_id: int) -> None:
        """Worker thread: copy layer `index`'s blob from the tier into slot `slot_id`."""
        slot = self.slots[slot_id]
        if slot.ready is None:
            fill(self.tier, index, slot.buffer)
        else:
            slot.ready.synchronize()                  # the previous copy out of staging has finished
            src = self.tier.source(index, slot.staging)
            with torch.cuda.stream(self._copy_stream):
                self._copy_stream.wait_event(slot.free)
                slot.buffer[:src.numel()].copy_(src, non_blocking=True)
                slot.ready.record(self._copy_stream)

    def _count_use(self, index: int, hit: bool, waited: float) -> None:
        s = self.stats
        s.loads += 1
        s.bytes += self.bindings[index].nbytes
        s.hits += hit
        s.waits += not hit
        s.wait_s += waited
        s.passes += index == self.order[0]

    # ---- lifecycle and telemetry --------------------------------------------------------
    def telemetry(self) -> dict:
        """Streaming counters plus memory: staging bytes, peak RSS and (CUDA) peak device memory."""
        out = self.stats.as_dict()
        out.update(streamed_layers=len(self.order), staging_slots=len(self.slots), staging_bytes=self.staging_bytes,
                   stream_tier=self.tier.name, peak_rss_bytes=peak_rss_bytes())
        if self.device.type == "cuda":
            out["peak_device_bytes"] = torch.cuda.max_memory_allocated(self.device)
        return out

    def reset_stats(self) -> None:
        with self._lock:
            self.stats = StreamStats()

    def close(self) -> None:
        """Remove the hooks, finish pending loads and release the tier."""
        for handle in self._handles:
            handle.remove()
        self._worker.shutdown(wait=True)
        self.tier.close()
