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

    def _run(self, run, kind: str, tokens: int, start: int, sequences: int = 1):
        """`run()` under the lock, timed and reported as a ForwardEvent when anyone listens (after
        the lock: an observer may run a forward of its own, as Scheduler.call lets it)."""
        with self.lock:
            began = time.perf_counter()
            out = run()
            seconds = time.perf_counter() - began
        if self.instruments.active:
            self.instruments.emit(ForwardEvent(kind, tokens, start, seconds, sequences))
        return out

    def forward(self, kv, token_ids: list[int], start: int, kind: str) -> torch.Tensor:
        """Compute `token_ids` at positions start.. over `kv`; logits [vocab] of the last one."""
        return self._run(lambda: self.forward_pass(kv, token_ids, start), kind, len(token_ids), start)

    def scattered(self, kv, token_ids: list[int], positions: torch.Tensor, end: int, selector=None) -> torch.Tensor:
        """Compute the tokens at `positions` over the KV in place (moved-reuse repair)."""
        return self._run(lambda: self.forward_pass.scattered(kv, token_ids, positions, end, selector),
                         "repair", len(positions), int(positions[0]))

    def attention_mass(self, kv, token_ids: list[int], positions: torch.Tensor, end: int, layers: int) -> torch.Tensor:
        """Attention the tokens at `positions` pay to every position over the first `layers` layers."""
        return self._run(lambda: self.forward_pass.attention_mass(kv, token_ids, positions, end, layers),
                         "probe", len(positions), int(positions[0]))

    def batch(self, items: list[tuple], want_logits: list[bool]) -> list:
        """One forward over several sequences' new tokens (see Forward.batch)."""
        tokens = sum(len(ids) for _, ids, _ in items)
        kind = "batch" if len(items) > 1 else ("decode" if tokens == 1 else "prefill")
        return self._run(lambda: self.forward_pass.batch(items, want_logits), kind, tokens,
                         items[0][2] if len(items) == 1 else -1, len(items))
