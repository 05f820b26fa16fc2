"""A sequence's KV as a block table over the shared pool (the default on CPU).

Cached prefix blocks are mapped in without copying; the sequence's own blocks are reserved up
front for prompt + new tokens (a request never fails half-way for lack of memory). Attention
runs over each run of consecutive blocks as a view and merges the runs by log-sum-exp.
"""
from __future__ import annotations

import torch

from .dense import attend_dense, attend_with_lse, merge_by_lse
from .element import load, store, value_dtype
from .pool import BlockPool


# Up to this many keys, a sequence whose blocks form several runs copies them into one buffer per
# layer and attends once (the copy is cheaper than a kernel call and an LSE merge per run); past
# it, each run is attended in place and the results merged by log-sum-exp.
GATHER_MAX_KEYS = 2048

# Sequences decoding together that read at least this many leading positions from the same pool
# blocks (a shared system prompt, a shared document) attend over them once, all their queries
# stacked (PagedSequence.attend_shared); below it, the merge costs more than the reads it saves.
SHARED_MIN_TOKENS = 32

# Of those shared positions, a run of consecutive pool slots at least this long is attended in
# place; shorter runs are gathered into one piece (a kernel call and a merge per short run would
# cost more than copying it).
SHARED_RUN_MIN_TOKENS = 128


class PagedSequence:
    allocates = False           # giving KV to the cache shares blocks

    def __init__(self, pool: BlockPool, capacity: int):
        self.pool = pool
        self.capacity = capacity
        self.device = pool.ram.device
        self.block_tokens = pool.block_tokens
        self.table: list[int] = []          # physical block of each block index
        self.copied: dict[int, tuple[int, int]] = {}    # block index -> (shared block it copies, positions copied up to)
        self._runs: dict[int, list] = {}
        self._slots: torch.Tensor | None = None

    # ---- building the table -------------------------------------------------------------
    def map_shared(self, blocks: list[int]) -> None:
        """Use cached blocks (already retained for this sequence) as the first block indices."""
        assert not self.table
        self.table = list(blocks)

    def copy_on_write(self, index: int, upto: int) -> None:
        """Give block `index` a private copy holding positions [index * B, upto) of the shared one."""
        shared = self.table[index]
        own = self.pool.allocate(1)[0]
        src, src_slot = self.pool.region(shared)
        dst, dst_slot = self.pool.region(own)
        count = upto - index * self.block_tokens
        dst[:, :, :, dst_slot:dst_slot + count] = src[:, :, :, src_slot:src_slot + count]
        self.table[index] = own
        self.copied[index] = (shared, upto)
        self.pool.release([shared])
        self._changed()

    def reserve(self) -> None:
        """Allocate private blocks for every position up to capacity."""
        needed = -(-self.capacity // self.block_tokens) - len(self.table)
        self.table.extend(self.pool.allocate(max(needed, 0)))
        self._changed()

    def release(self) -> None:
        self.pool.release(self.table)
        self.table = []
        self._changed()

    def cache_blocks(self, first_index: int, end: int) -> list[int]:
        """This sequence's blocks for block indices first_index.. up to `end`, one new reference each."""
        blocks = self.table[first_index:-(-end // self.block_tokens)]
        self.pool.retain(blocks)
        return list(blocks)

    def load(self, kv: torch.Tensor, start: int) -> None:
        """Copy KV rows as stored `[2, layers, kv_heads, n, row_width]` in at `start` (into private blocks)."""
        self.pool.write(self.table, start, kv)

    def _changed(self) -> None:
        self._runs.clear()
        self._slots = None

    # ---- data access --------------------------------------------------------------------
    def runs(self, end: int):
        if end not in self._runs:
            self._runs[end] = self.pool.runs(self.table, end)
        return self._runs[end]

    def slots(self) -> torch.Tensor:
        """Slot index of every position (RAM region only), for scattered reads and writes."""
        if self._slots is None:
            b = self.block_tokens
            device = self.pool.ram.device
            table = torch.tensor(self.table, dtype=torch.long, device=device)
            self._slots = (table[:, None] * b + torch.arange(b, device=device)[None, :]).flatten()
        return self._slots

    def slot_view(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the pool's RAM [2, layers, kv_heads, slots, row_width], slot of every position) for code
        that reads and writes KV by slot (the native decode step); None while blocks are spilled."""
        return (self.pool.ram, self.slots()) if self._scatter_ok() else None

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor, start: int) -> None:
        end = start + keys.shape[2]
        keys, values = store(keys, self.pool.ram.dtype), store(values, self.pool.ram.dtype)
        for tensor, slot, pos, n in self.runs(end):
            lo, hi = max(pos, start), min(pos + n, end)
            if lo < hi:
                tensor[0, layer, :, slot + lo - pos:slot + hi - pos] = keys[0, :, lo - start:hi - start]
                tensor[1, layer, :, slot + lo - pos:slot + hi - pos] = values[0, :, lo - start:hi - start]

    def _scatter_ok(self) -> bool:
        return self.pool.spill_blocks == 0 or max(self.table) < self.pool.ram_blocks

    def write_at(self, layer: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        if not self._scatter_ok():
            for i, p in enumerate(positions.tolist()):
                self.write(layer, keys[:, :, i:i + 1], values[:, :, i:i + 1], p)
            return
        slots = self.slots()[positions.to(self.pool.ram.device)]
        ram = self.pool.ram
        ram[0, layer, :, slots] = store(keys[0], ram.dtype)
        ram[1, layer, :, slots] = store(values[0], ram.dtype)

    def gather(self, layer: int, positions: torch.Tensor):
        """K and V at `positions` as values (int8 rows decoded): `[1, kv_heads, n, head_dim]` each."""
        dtype = value_dtype(self.pool.ram.dtype)
        if not self._scatter_ok():
            kv = self.pool.read(self.table, 0, int(positions.max()) + 1)[:, layer][:, :, positions]
            return load(kv[0][None], dtype), load(kv[1][None], dtype)
        slots = self.slots()[positions.to(self.pool.ram.device)]
        return load(self.pool.ram[0, layer, :, slots][None], dtype), load(self.pool.ram[1, layer, :, slots][None], dtype)

    def attend(self, layer: int, query, mask, is_causal: bool, scaling: float, end: int, explicit_mask,
               q_range: tuple[int, int] = (0, 0), window: int | None = None):
        # query [1, H, N, D] at positions within q_range (inclusive) -> [1, H, N, D]
        runs = self.runs(end)
        if len(runs) == 1 or end <= GATHER_MAX_KEYS:
            keys, values = (load(_joined([tensor[i, layer, :, slot:slot + n] for tensor, slot, _, n in runs])[None],
                                 query.dtype) for i in (0, 1))
            return attend_dense(query, keys, values, mask, is_causal, scaling)
        full = None
        parts = []
        for tensor, slot, pos, n in runs:
            if pos > q_range[1]:
                continue                                    # entirely after every query
            run_mask = None
            if window is not None or pos + n - 1 > q_range[0]:
                full = explicit_mask() if full is None else full
                run_mask = None if full is None else full[:, pos:pos + n]
                if run_mask is not None and not bool(run_mask.any()):
                    continue
            keys, values = tensor[0, layer, :, slot:slot + n][None], tensor[1, layer, :, slot:slot + n][None]
            parts.append(attend_with_lse(query, keys, values, run_mask, scaling))
        return merge_by_lse(parts)

    # ---- several sequences at once (a batched decode step) ------------------------------
    def shared_prefix(self, seqs: list[PagedSequence], ends: list[int]) -> int:
        """Leading positions that all of `seqs` (this one first) read from the same pool blocks:
        whole blocks, short of each one's last position (so each has keys of its own after them);
        0 when fewer than SHARED_MIN_TOKENS, or when a sequence has blocks in the disk spill (its
        keys are then not addressable by RAM slot; it attends on its own)."""
        if not all(seq._scatter_ok() for seq in seqs):
            return 0
        count, limit = 0, min(len(seq.table) for seq in seqs)
        while (count < limit and self.table[count] is not None
               and all(seq.table[count] == self.table[count] for seq in seqs)):
            count += 1
        shared = min(count * self.block_tokens, min(ends) - 1)
        return shared if shared >= SHARED_MIN_TOKENS else 0

    def attend_shared(self, seqs: list[PagedSequence], ends: list[int], layer: int, query, keys, values,
                      scaling: float, shared: int, scratch: dict):
        """One decode step of `seqs` in one layer, reading the `shared` leading positions they have
        in common (`shared_prefix`) once: keys/values [1, Hkv, M, D] are each sequence's new K/V
        (written at position ends[i] - 1), query [1, H, M, D] its query there (no window) ->
        [1, H, M, D]. All M queries attend over the shared keys together (long runs of blocks in
        place, short ones gathered into one piece: no order among keys matters without a mask),
        and over their own keys after them in one padded call; the parts are merged by log-sum-exp
        (cascade attention): the same attention as each alone, up to float rounding. `scratch` (one
        dict per group and forward, empty at first) keeps the slot indices the layers reuse."""
        if not scratch:
            scratch.update(self._shared_plan(seqs, ends, shared))
        ram = self.pool.ram
        ram[0, layer].index_copy_(1, scratch["new"], store(keys[0], ram.dtype))
        ram[1, layer].index_copy_(1, scratch["new"], store(values[0], ram.dtype))
        parts = [attend_with_lse(query, ram[0, layer, :, slot:slot + n][None], ram[1, layer, :, slot:slot + n][None],
                                 None, scaling) for slot, n in scratch["runs"]]
        if scratch["gathered"] is not None:
            parts.append(attend_with_lse(query, ram[0, layer].index_select(1, scratch["gathered"])[None],
                                         ram[1, layer].index_select(1, scratch["gathered"])[None], None, scaling))
        parts.append(self._attend_tails(layer, query, scaling, scratch))
        lses = torch.softmax(torch.stack([lse.float() for _, lse in parts]), dim=0).unsqueeze(-1)   # [P, 1, H, M, 1]
        out = parts[0][0].float() * lses[0]
        for (part, _), weight in zip(parts[1:], lses[1:]):
            out = out.add_(part.float() * weight)
        return out.to(query.dtype)

    def _attend_tails(self, layer: int, query, scaling: float, scratch: dict):
        """Each query over its own keys after the shared ones, padded to one width (pads masked):
        (out [1, H, M, D], lse [1, H, M]). Every row has at least its new key, so no row is empty."""
        _, heads, m, dim = query.shape
        ram = self.pool.ram
        kv_heads = ram.shape[2]
        tail_k, tail_v = (load(ram[i, layer].index_select(1, scratch["tail"]), torch.float32).view(kv_heads, m, -1, dim)
                          for i in (0, 1))                                                   # [Hkv, M, L, D]
        q = query[0].view(kv_heads, heads // kv_heads, m, dim).transpose(1, 2).float()         # [Hkv, M, G, D]
        scores = torch.matmul(q, tail_k.float().transpose(-1, -2)).mul_(scaling)              # [Hkv, M, G, L]
        scores.masked_fill_(scratch["pad"], float("-inf"))
        top = scores.amax(dim=-1, keepdim=True)
        weights = scores.sub_(top).exp_()
        total = weights.sum(dim=-1, keepdim=True)
        out = torch.matmul(weights, tail_v.float()).div_(total)                              # [Hkv, M, G, D]
        lse = total.log_().add_(top).squeeze(-1)                                             # [Hkv, M, G]
        return out.transpose(1, 2).reshape(1, heads, m, dim), lse.transpose(1, 2).reshape(1, heads, m)

    def _shared_plan(self, seqs: list[PagedSequence], ends: list[int], shared: int) -> dict:
        """Slots of the shared keys (runs of at least SHARED_RUN_MIN_TOKENS read in place, the rest
        gathered), of each sequence's new position, and of its keys after the shared ones, padded
        to one width with its new position (written this step, so never stale memory; masked)."""
        runs, short = [], []
        for _, slot, _, n in self.pool.runs(self.table, shared):        # RAM only: no spill blocks here
            (runs if n >= SHARED_RUN_MIN_TOKENS else short).append((slot, n))
        device = self.pool.ram.device
        gathered = (torch.cat([torch.arange(slot, slot + n, device=device) for slot, n in short])
                    if short else None)
        new = torch.stack([seq.slots()[end - 1] for seq, end in zip(seqs, ends)])
        width = max(ends) - shared
        tail = new[:, None].repeat(1, width)
        pad = torch.ones(len(seqs), width, dtype=torch.bool, device=device)
        for row, (seq, end) in enumerate(zip(seqs, ends)):
            tail[row, :end - shared] = seq.slots()[shared:end]
            pad[row, :end - shared] = False
        return {"runs": runs, "gathered": gathered, "tail": tail.flatten(), "pad": pad[None, :, None, :], "new": new}


def _joined(views: list) -> torch.Tensor:
    return views[0] if len(views) == 1 else torch.cat(views, dim=1)
