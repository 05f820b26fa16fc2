"""Where forwards run: one lock (one forward at a time per engine) and the instrumentation of each."""
from __future__ import annotations

import threading
import time

import torch

from ..instrument import ForwardEvent, Instruments
from ..model.forward import Forward


class ModelRunner:
    def __init__(self, forward: Forward, instruments: Instruments):
        self.forward_pass = forward
        self.instruments = instruments
        self.lock = threading.Lock()

    def forward(self, kv, token_ids: list[int], start: int, kind: str) -> torch.Tensor:
        """Compute `token_ids` at positions start.. over `kv`; logits [vocab] of the last one."""
        with self.lock:
            if not self.instruments.active:
                return self.forward_pass(kv, token_ids, start)
            began = time.perf_counter()
            logits = self.forward_pass(kv, token_ids, start)
            self.instruments.emit(ForwardEvent(kind, len(token_ids), start, time.perf_counter() - began))
            return logits

    def scattered(self, kv, token_ids: list[int], positions: torch.Tensor, end: int, selector=None) -> torch.Tensor:
        """Compute the tokens at `positions` over the KV in place (moved-reuse repair)."""
        with self.lock:
            began = time.perf_counter()
            logits = self.forward_pass.scattered(kv, token_ids, positions, end, selector)
            if self.instruments.active:
                self.instruments.emit(ForwardEvent("repair", len(positions), int(positions[0]),
                                                   time.perf_counter() - began))
            return logits

    def attention_mass(self, kv, token_ids: list[int], positions: torch.Tensor, end: int, layers: int) -> torch.Tensor:
        """Attention the tokens at `positions` pay to every position over the first `layers` layers."""
        with self.lock:
            began = time.perf_counter()
            mass = self.forward_pass.attention_mass(kv, token_ids, positions, end, layers)
            if self.instruments.active:
                self.instruments.emit(ForwardEvent("probe", len(positions), int(positions[0]),
                                                   time.perf_counter() - began))
            return mass

    def batch(self, items: list[tuple], want_logits: list[bool]) -> list:
        """One forward over several sequences' new tokens (see Forward.batch)."""
        with self.lock:
            began = time.perf_counter()
            logits = self.forward_pass.batch(items, want_logits)
            if self.instruments.active:
                tokens = sum(len(ids) for _, ids, _ in items)
                kind = "batch" if len(items) > 1 else ("decode" if tokens == 1 else "prefill")
                self.instruments.emit(ForwardEvent(kind, tokens, items[0][2] if len(items) == 1 else -1,
                                                   time.perf_counter() - began, len(items)))
            return logits
