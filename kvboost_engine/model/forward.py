"""Our own loop over the decoder layers: embeddings, rotary, layers, final norm, lm_head.

`kv` is a sequence's KV (kv/contiguous.py or kv/paged.py; any object with their `write`,
`write_at`, `gather`, `attend` and `device`); a selector narrows a scattered forward after one
layer (see request/blend.py). Neither is imported: this room depends on no other.
"""
from __future__ import annotations

from typing import Protocol

import torch

from .arch import ModelAdapter
from .attention import AttentionStep, BatchStep, ProbeStep, ScatterStep, kvboost_name


class TokenSelector(Protocol):
    layer: int

    def keep(self, deviation: torch.Tensor) -> torch.Tensor:
        """Indices (ascending) of the active tokens to keep after `layer`, given their KV deviation [A]."""


def use_kvboost_attention(model: torch.nn.Module) -> None:
    """Route the model's attention modules to our function (plain HF calls keep behaving exactly as
    with the model's original attention implementation, masks included)."""
    name = kvboost_name(model.config._attn_implementation)
    try:
        model.set_attn_implementation(name)
    except (AttributeError, ValueError, KeyError, ImportError):
        model.config._attn_implementation = name
    if model.config._attn_implementation != name:
        model.config._attn_implementation = name


class FastDecode(Protocol):
    batch_limit: int        # decoding sequences per fast step (decode_rows); more take several steps
    native_prefill: bool    # False: prompt chunks of more than one token take the layer loop, not prefill()

    def __call__(self, kv, token_id: int, position: int) -> torch.Tensor | None:
        """Compute one token at `position` over `kv` (its KV written in place) and return logits
        [vocab] (fp32), or None when it cannot run on this KV (the layer loop runs instead)."""

    def refusal(self, kv, position: int) -> str | None:
        """Why a step at `position` cannot run on `kv` (None: it can)."""

    def decode_rows(self, items: list[tuple]) -> list[torch.Tensor | None]:
        """One step over several sequences, items (kv, token_id, position): each one's logits, the
        same numbers as its own step, or None for an item whose KV cannot run it (the others run)."""

    def prefill(self, kv, token_ids: list[int], start: int) -> torch.Tensor | None:
        """Tokens at start.. over `kv` (a plain chunk, as __call__ below): the last one's logits, or None.
        Not called where `native_prefill` is False (the layer loop runs chunks)."""


class Forward:
    """Runs new tokens over a sequence's KV and returns last-position logits.

    `fast_decode` (optional; native/decoder.py) takes plain steps: a token or a chunk of one
    sequence, a token of each of several; any step it cannot run takes the layer loop, counted by
    reason in `fallbacks` (sequence steps; prompt chunks that take the loop by design, where
    `fast_decode.native_prefill` is False, are not counted)."""

    def __init__(self, adapter: ModelAdapter, fast_decode: FastDecode | None = None):
        self.adapter = adapter
        self.fast_decode = fast_decode
        self.fallbacks: dict[str, int] = {}
        self._static_rope = adapter.static_rope
        use_kvboost_attention(adapter.model)

    def _fell_back(self, reason: str | None) -> None:
        reason = reason or "the fast step declined"
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1

    @torch.inference_mode()
    def __call__(self, kv, token_ids: list[int], start: int) -> torch.Tensor:
        """Compute KV for `token_ids` at positions start.. and return logits [vocab] (fp32)."""
        fast = self.fast_decode
        if fast is not None and (len(token_ids) == 1 or fast.native_prefill):
            # (prompt chunks take the layer loop where native_prefill is off: fast_decode.prefill_off)
            logits = fast(kv, token_ids[0], start) if len(token_ids) == 1 else fast.prefill(kv, token_ids, start)
            if logits is not None:
                return logits
            self._fell_back(fast.refusal(kv, start + len(token_ids) - 1))
        return self._loop(kv, token_ids, start)

    def _loop(self, kv, token_ids: list[int], start: int) -> torch.Tensor:
        """The layer loop over one sequence's new tokens: logits [vocab] after the last."""
        a = self.adapter
        end = start + len(token_ids)
        ids = torch.tensor([token_ids], dtype=torch.long, device=a.device)          # [1, N]
        positions = torch.arange(start, end, device=a.device)[None, :]              # [1, N]
        hidden = a.embed(ids)                                                       # [1, N, hidden]
        rope = a.position_embeddings(hidden, positions, getattr(kv, "rope_end", None))
        step = AttentionStep(kv, start, end, a.layer_windows)
        for layer_idx in range(len(a.layers)):
            hidden = a.run_layer(layer_idx, hidden, rope, positions, step)
        return a.logits_last(hidden)

    @torch.inference_mode()
    def scattered(self, kv, token_ids: list[int], positions: torch.Tensor, end: int,
                  selector: TokenSelector | None = None) -> torch.Tensor:
        """Compute the tokens at `positions` (ascending, the last one is end - 1) over the KV
        already in `kv`; with a selector, narrow to the tokens it keeps after its check layer."""
        a = self.adapter
        positions = positions.to(a.device)
        ids = torch.tensor(token_ids, dtype=torch.long, device=a.device)[positions][None]   # [1, A]
        hidden = a.embed(ids)                                                                # [1, A, hidden]
        masks: dict = {}
        rope = a.position_embeddings(hidden, positions[None])          # recomputed only when narrowed
        for layer_idx in range(len(a.layers)):
            measure = selector is not None and layer_idx == selector.layer
            step = ScatterStep(kv, positions, end, a.layer_windows, measure, masks)
            hidden = a.run_layer(layer_idx, hidden, rope, positions[None], step)
            if measure:
                keep = selector.keep(step.deviation).to(a.device)
                hidden, positions = hidden[:, keep], positions[keep]
                masks = {}
                rope = a.position_embeddings(hidden, positions[None])
        return a.logits_last(hidden)

    @torch.inference_mode()
    def attention_mass(self, kv, token_ids: list[int], positions: torch.Tensor, end: int, layers: int) -> torch.Tensor:
        """Run the tokens at `positions` through the first `layers` layers over the KV in `kv` (their
        own KV is written) and return the attention they pay to each position: [end] (fp32)."""
        a = self.adapter
        positions = positions.to(a.device)
        ids = torch.tensor(token_ids, dtype=torch.long, device=a.device)[positions][None]   # [1, A]
        hidden = a.embed(ids)
        mass = torch.zeros(end, dtype=torch.float32)
        masks: dict = {}
        for layer_idx in range(min(layers, len(a.layers))):
            step = ProbeStep(kv, positions, end, a.layer_windows, mass, masks)
            rope = a.position_embeddings(hidden, positions[None])
            hidden = a.run_layer(layer_idx, hidden, rope, positions[None], step)
        return mass

    @torch.inference_mode()
    def batch(self, items: list[tuple], want_logits: list[bool]) -> list:
        """One forward over several sequences: items are (kv, token_ids, start); returns the logits
        [vocab] (fp32) after each item's last token where `want_logits`, else None. The weights are
        read once for all of them; each sequence attends over its own KV. A single item takes the
        single-sequence path (the same numbers as before batching). With `fast_decode`, the decoding
        sequences it accepts take its step, `batch_limit` at a time, and its chunks as alone (the fast
        step is batch-invariant: every row's numbers as in its own step, whatever shares the step);
        an item it refuses (KV spilled to disk) takes the layer loop alone, its numbers as alone too.
        Without `fast_decode`, the layer loop runs all of them together."""
        if len(items) == 1:
            kv, token_ids, start = items[0]
            return [self(kv, token_ids, start)]
        fast = self.fast_decode
        if fast is None:
            return self._loop_batch(items, want_logits)
        logits = [None] * len(items)
        decoding = [i for i, (_, ids, _) in enumerate(items) if len(ids) == 1]
        for lo in range(0, len(decoding), fast.batch_limit):
            part = decoding[lo:lo + fast.batch_limit]
            for i, out in zip(part, fast.decode_rows([(items[i][0], items[i][1][0], items[i][2]) for i in part])):
                kv, ids, start = items[i]
                if out is None:                     # refused (KV spilled): the layer loop, alone
                    self._fell_back(fast.refusal(kv, start))
                    out = self._loop(kv, ids, start)
                logits[i] = out
        for i, (kv, ids, start) in enumerate(items):
            if len(ids) > 1:                        # as alone: the fast prefill, else the layer loop (counted
                logits[i] = self(kv, ids, start)    # where refused, not where native_prefill is off by design)
        return [out if want else None for out, want in zip(logits, want_logits)]

    def _loop_batch(self, items: list[tuple], want_logits: list[bool]) -> list:
        """The layer loop over several sequences at once (batch()'s items), each over its own KV."""
        a = self.adapter
        rows, steps, positions, lo = [], [], [], 0
        for kv, token_ids, start in items:
            end = start + len(token_ids)
            rows.append((lo, lo + len(token_ids)))
            steps.append(AttentionStep(kv, start, end, a.layer_windows))
            positions.append(torch.arange(start, end, device=a.device))
            lo += len(token_ids)
        ids = torch.tensor([[t for _, token_ids, _ in items for t in token_ids]], dtype=torch.long,
                           device=a.device)                                                 # [1, T]
        hidden = a.embed(ids)                                                               # [1, T, hidden]
        if self._static_rope:
            rope = a.position_embeddings(hidden, torch.cat(positions)[None])
        else:       # longrope / dynamic: each sequence's cos / sin as alone (a call's largest position chooses)
            ropes = [a.position_embeddings(hidden[:, lo:hi], p[None], getattr(kv, "rope_end", None))
                     for (lo, hi), p, (kv, _, _) in zip(rows, positions, items)]
            rope = {kind: tuple(torch.cat([r[kind][j] for r in ropes], dim=1) for j in range(len(ropes[0][kind])))
                    for kind in ropes[0]}
        positions = torch.cat(positions)[None]                                              # [1, T]
        step = BatchStep(steps, rows)
        for layer_idx in range(len(a.layers)):
            hidden = a.run_layer(layer_idx, hidden, rope, positions, step)
        wanted = [hi - 1 for (_, hi), want in zip(rows, want_logits) if want]
        logits = iter(a.logits_at(hidden, wanted)) if wanted else iter(())
        return [next(logits) if want else None for want in want_logits]
