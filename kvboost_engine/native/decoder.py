"""The native step (decode.cpp), for float32 models, models converted with weights="int4", and
PackedLinear models.

A step is one call into native code over M rows, which runs every layer: no PyTorch op per norm,
projection or attention. A row is one token of a sequence over that sequence's KV: a decode step
of one sequence (`__call__`), of several together (`decode_rows`), or a prompt chunk of one
(`prefill`, every row's K and V written before each row attends up to its own position). Each
row's arithmetic is the same whatever shares the step, so batched decode gives the same numbers as
serial steps and a prompt the same numbers in any chunking. Weights are repacked at load from the
converted int4 modules (weights/formats.py) into tiles of 16 rows x 32 columns, the layout the
kernel reads (`pack_codes`): the same codes and scales as the int4 layers and the int8 head, so the
step computes with the same weights; the activations are quantized to int8 per block of 32 for the
integer dot products, and the 8 best logits are recomputed in float from the float activations (as
the PyTorch path does). Everything else (scattered recompute, probes) stays on the PyTorch path; a
step whose KV is not addressable by slot (blocks spilled to disk) too.

A float32 model keeps its own weights: the step reads the model's float matrices in place (no
copy) with float activations, the same arithmetic as the PyTorch step up to the order of additions
(greedy replies are the same on the tests and benchmarks; exact reuse stays exact, since a request
with and without cache decodes through the same step). A model whose every decoder linear is a
PackedLinear (weights/packed.py: a quantized file's codes, d in bf16 / fp16 / fp32, m in fp16 / fp32,
already in the kernel's tiles; an AWQ checkpoint's layers with awq_kernel="native"), with the head
one too or float32 (AWQ's), is read in place too: no copy, no repack.

KV is float32, float16 / bfloat16 or int8 (EngineConfig.kv_dtype): the step reads those rows as floats
(int8: code * scale) and writes its own K and V as the PyTorch path stores them (kv/element.py:
rounded to nearest even, or quantized per block of 32), the same bytes for the same values.

Supported: the Llama layout with RMSNorm, full rotary and SiLU (llama, mistral, qwen2 model
types; qwen3 with its RMSNorm over each query and key head before the rotary; gemma3_text with
those, its norms after attention and MLP, GELU (tanh), and a second rotary for its global layers,
its final logit soft-cap applied to the step's logits as the PyTorch path applies it), float32, and
either every decoder linear layer in int4 with the head in int8 (`weights="int4"`), or every one
of them in float32, or every one of them packed.
"""
from __future__ import annotations

import ctypes

import torch

from ..model.arch import ModelAdapter
from . import abi, build
from .matrices import ABSENT, embeds_from_head, float_matrix, head_matrix, joined, packed, weights_kind
from .support import KV_AHEAD_ENV, PREFILL_ENV, float_prefill_off, kv_ahead, unsupported_reason  # noqa: F401 (ENVs read here)

ROPE_TABLE = 1024                                   # positions of cos/sin computed per table extension
PREFILL_ROWS = 128                                  # rows per native step of a prompt chunk (scratch memory)
KEY_BLOCK = 256                                     # keys per attention task (decode.cpp KEY_BLOCK)
# A step's attention partials (decode.cpp part_o: head_dim floats per query head, key block and row,
# kept by the library from step to step) at most this many bytes, past a single row: at long contexts
# a step takes fewer rows (128 rows at 128k tokens of 32 heads x 128 would hold 1 GiB), the same numbers.
PARTIALS_BYTES = 256 << 20


class NativeRefusal(Exception):
    """The library refused a model (kvb_decoder_new: a shape or scale type its kernels do not read, or
    memory for its scratch it could not allocate); native_decoder() gives the reason instead."""


class NativeDecoder:
    """`decoder(kv, token_id, position)` -> logits [vocab] (fp32) after computing the token's KV in
    place, or None when this KV cannot be addressed by slot (then use the PyTorch path)."""

    def __init__(self, adapter: ModelAdapter, lib, threads: int):
        self.adapter = adapter
        self._lib = lib
        plain, g = adapter.plain_llama()[0], adapter.geometry
        self._keep = []                                         # every tensor the native side points at
        self.kv_dtype = g.dtype                                 # float32, float16 / bfloat16 or int8 (kv_dtype)
        self.kind = weights_kind(adapter)
        # Sequences decoding together: up to this many take one native step over all of them (one
        # row each, each row's numbers the same as its step alone); more take several such steps.
        self.batch_limit = 64
        # why prompt chunks of more than one token take the PyTorch loop, not prefill() (None: they do not)
        self.prefill_off = float_prefill_off() if self.kind == "float" else None
        self.kv_ahead = kv_ahead()                              # one-row attention's KV requests
        parts = [adapter.layer_parts(i) for i in range(len(adapter.layers))]
        # the rotary kinds of the layers (Gemma 3: local and global bases), in a row's cos / sin order
        self._kinds = list(dict.fromkeys(adapter.layer_rope_kinds))
        stack = (abi.LayerArgs * len(parts))()
        for layer, args, window, kind in zip(parts, stack, adapter.layer_windows, adapter.layer_rope_kinds):
            if self.kind == "int4":
                q, k, v, o, gate, up, down = layer.linears
                mats = [joined([q, k, v], 4), ABSENT, ABSENT, joined([o], 4), joined([gate, up], 4), ABSENT,
                        joined([down], 4)]
            elif self.kind == "packed":
                mats = [packed(m) for m in layer.linears]
            else:
                mats = [float_matrix(m) for m in layer.linears]
            args.in_norm, args.post_norm = self._hold(layer.input_norm.float()), self._hold(layer.post_norm.float())
            args.q_norm, args.k_norm, args.attn_norm, args.mlp_norm = (
                0 if w is None else self._hold(w.float()) for w in (layer.q_norm, layer.k_norm, layer.attn_norm, layer.mlp_norm))
            for name, mat in zip(abi.MATRICES, mats):
                setattr(args, name, abi.mat_args(mat, self._hold))
            args.window = window or 0
            args.rope = self._kinds.index(kind)
        head = head_matrix(self.kind, adapter.lm_head)
        self.vocab = head["dims"][0]
        self.exact_top = int(getattr(adapter.lm_head, "exact_top", 0))
        model = abi.ModelArgs(len(parts), plain.hidden, plain.heads, g.kv_heads, g.head_dim, plain.intermediate,
                              self.vocab, self.exact_top, threads, abi.KV_TYPES[g.dtype], abi.ACTS[plain.act],
                              int(self.kv_ahead),
                              plain.rms_norm_eps,
                              parts[0].scaling, stack, self._hold(plain.final_norm.float()),
                              abi.mat_args(head, self._hold))
        why = ctypes.create_string_buffer(512)
        self._handle = lib.kvb_decoder_new(ctypes.byref(model), why, len(why))
        if not self._handle:                                   # the library's own check of shapes and types
            raise NativeRefusal(why.value.decode(errors="replace"))
        # int8 keys scored against the query in int8 (decode.cpp i8_scores): over int8 KV where some
        # matrix takes int8 activations anyway, heads of up to 1,024 (Decoder::i8_queries, as the library says)
        self.int8_queries = bool(lib.kvb_decoder_int8_queries(self._handle))
        self._embed_native = embeds_from_head(adapter, self.kind)
        self.threads = threads
        self.isa = getattr(lib, "isa", None)                 # the instruction-set variant (build.ISAS)
        self._static_rope = adapter.static_rope
        self._tables = None                                   # per kind: cos, sin [positions, head_dim]
        self._block_partials = plain.heads * g.head_dim * 4   # bytes of a row's partials per key block
        self._strides = {}

    @property
    def native_prefill(self) -> bool:
        """Whether prompt chunks run natively (Forward calls prefill()) or on the PyTorch loop."""
        return self.prefill_off is None

    def _hold(self, tensor: torch.Tensor) -> int:
        tensor = tensor.detach().contiguous()
        self._keep.append(tensor)
        return tensor.data_ptr()

    def _rotary(self, position: int) -> list[torch.Tensor]:
        """cos, sin [head_dim] at `position` of each rotary kind (in self._kinds order), from the
        model's own rotary module: a decode step's, as the PyTorch path computes a one-token step's."""
        return self._rotary_span(position, 1)[0]

    def _rotary_span(self, start: int, count: int, regime_end: int | None = None) -> list[list[torch.Tensor]]:
        """Each of positions start..start+count-1: its cos, sin [head_dim] of each rotary kind. A
        rotary whose frequencies depend on the sequence length (longrope, dynamic) is computed in one
        call over the span, as the PyTorch path computes a prompt chunk's (the length its last
        position gives chooses the frequencies of every row); the others come from a table."""
        a = self.adapter
        if not self._static_rope:
            tables = a.position_embeddings(torch.zeros(1, 1, 1), torch.arange(start, start + count)[None], regime_end)
            span = [t[0].float().contiguous() for kind in self._kinds for t in tables[kind]]
            return [[t[i] for t in span] for i in range(count)]
        end = start + count
        if self._tables is None or end > self._tables[0].shape[0]:
            end = ((end - 1) // ROPE_TABLE + 1) * ROPE_TABLE
            tables = a.position_embeddings(torch.zeros(1, 1, 1), torch.arange(end)[None])
            self._tables = [t[0].float().contiguous() for kind in self._kinds for t in tables[kind]]
        return [[t[p] for t in self._tables] for p in range(start, start + count)]

    def _view(self, kv, position: int):
        return self._view_or_why(kv, position)[0]

    def _view_or_why(self, kv, position: int) -> tuple:
        """(the KV's (RAM, slots) view, None), or (None, why a step at `position` cannot run on it)."""
        if not hasattr(kv, "slot_view"):
            return None, f"KV without slots ({type(kv).__name__})"
        view = kv.slot_view()
        if view is None:
            return None, "KV blocks spilled to disk"
        ram, slots = view
        if ram.dtype != self.kv_dtype or ram.stride(-1) != 1 or slots.dtype != torch.int64:
            return None, f"KV stored as {ram.dtype} with strides {tuple(ram.stride())} (the step reads {self.kv_dtype} rows)"
        if position >= len(slots):
            return None, "a position past the KV's slots"
        return view, None

    def refusal(self, kv, position: int) -> str | None:
        """Why a step at `position` cannot run on this KV (None: it can); stats() counts these."""
        return self._view_or_why(kv, position)[1]

    def _row(self, view, position: int, want: bool, tables: list, keep: list) -> abi.Row:
        ram, slots = view
        strides = self._strides.get(ram.stride())
        if strides is None:
            strides = self._strides[ram.stride()] = _longs(ram.stride()[:4])
        keep += tables                                          # cos, sin of each kind
        cos, sin, cos2, sin2 = (tables * 2)[:4]                 # one kind: its pair twice
        return abi.Row(ram.data_ptr(), ctypes.addressof(strides), slots.data_ptr(), position, cos.data_ptr(),
                       sin.data_ptr(), int(want), cos2.data_ptr(), sin2.data_ptr())

    def _partials(self, position: int) -> int:
        """Bytes of attention partials a row at `position` takes in a step (decode.cpp step())."""
        return self._block_partials * ((position + KEY_BLOCK) // KEY_BLOCK)

    def _split(self, positions: list[int], most: int) -> list[tuple[int, int]]:
        """Consecutive runs (lo, hi) of rows, each at most `most` rows and PARTIALS_BYTES of partials
        (a row alone whatever its own)."""
        runs, lo, size = [], 0, 0
        for i, p in enumerate(positions):
            need = self._partials(p)
            if i > lo and (i - lo >= most or size + need > PARTIALS_BYTES):
                runs.append((lo, i))
                lo, size = i, 0
            size += need
        return runs + [(lo, len(positions))] if positions else runs

    def _step(self, rows: list[tuple], token_ids: list[int]) -> torch.Tensor:
        """One native step: rows (KV view, position, logits wanted, the position's cos / sin of each
        rotary kind) with their tokens -> the wanted rows' logits [wanted, vocab]; every row's K and V
        are written before any row attends. MemoryError where the library cannot allocate the step's
        scratch, ValueError for a position past its range: then nothing is computed and no KV written."""
        if not self._handle:
            raise RuntimeError("this native decoder is closed")
        keep: list = []
        array = (abi.Row * len(rows))(*(self._row(view, p, want, tables, keep) for view, p, want, tables in rows))
        x = self._embed(token_ids)
        logits = torch.empty(sum(bool(want) for _, _, want, _ in rows), self.vocab, dtype=torch.float32)
        failed = self._lib.kvb_decoder_rows(self._handle, len(rows), x.data_ptr(), array, logits.data_ptr())
        if failed:                                              # nothing computed, no KV written
            raise _step_error(failed, rows)
        cap = self.adapter.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap      # as ModelAdapter.logits_at

    def _embed(self, token_ids: list[int]) -> torch.Tensor:
        """The tokens' input embeddings [M, hidden] (float32): decoded natively from the packed head
        where it is the embedding table (the same numbers as PackedEmbedding, without its ~20 small
        PyTorch ops: 150-300 us of a 4 ms step), else the model's own lookup."""
        if self._embed_native:
            x = torch.empty(len(token_ids), self.adapter.embed.embedding_dim, dtype=torch.float32)
            ids = (ctypes.c_int64 * len(token_ids))(*token_ids)
            if self._lib.kvb_decoder_embed(self._handle, len(token_ids), ids, x.data_ptr()) == 0:
                return x
        return self.adapter.embed(torch.tensor([token_ids]))[0].float().contiguous()

    @torch.inference_mode()
    def __call__(self, kv, token_id: int, position: int) -> torch.Tensor | None:
        view = self._view(kv, position)
        return None if view is None else self._step([(view, position, True, self._rotary(position))], [token_id])[0]

    @torch.inference_mode()
    def decode_rows(self, items: list[tuple]) -> list[torch.Tensor | None]:
        """One step over several sequences, items (kv, token_id, position): each one's logits [vocab],
        the same numbers as its own step, or None for an item whose KV cannot be addressed by slot
        (`refusal` says why; the others run all the same)."""
        views = [self._view(kv, position) for kv, _, position in items]
        runs = [i for i, view in enumerate(views) if view is not None]
        rows = [(views[i], items[i][2], True, self._rotary(items[i][2])) for i in runs]
        tokens = [items[i][1] for i in runs]
        out: list = [None] * len(items)
        done = [t for lo, hi in self._split([p for _, p, _, _ in rows], len(rows))
                for t in self._step(rows[lo:hi], tokens[lo:hi])]
        for i, logits in zip(runs, done):
            out[i] = logits
        return out

    @torch.inference_mode()
    def prefill(self, kv, token_ids: list[int], start: int) -> torch.Tensor | None:
        """Tokens at start.. of one sequence, in steps of up to PREFILL_ROWS rows (each row's numbers
        do not depend on the rows beside it): the last one's logits [vocab], or None (not by slot)."""
        view = self._view(kv, start + len(token_ids) - 1)
        if view is None:
            return None
        tables = self._rotary_span(start, len(token_ids), getattr(kv, "rope_end", None))   # as the PyTorch path
        for lo, hi in self._split(range(start, start + len(token_ids)), PREFILL_ROWS):
            last = hi == len(token_ids)
            rows = [(view, start + i, last and i == hi - 1, tables[i]) for i in range(lo, hi)]
            logits = self._step(rows, token_ids[lo:hi])
        return logits[0]

    def close(self) -> None:
        if self._handle:
            self._lib.kvb_decoder_free(self._handle)
            self._handle = None
            self._keep.clear()

    def __del__(self):
        try:
            self.close()
        except Exception:           # interpreter shutdown
            pass


def native_decoder(adapter: ModelAdapter, threads: int | None = None,
                   isa: str | None = None) -> tuple[NativeDecoder | None, str | None]:
    """(a decoder, None) for this model on this machine, or (None, why not); isa: the instruction-set
    variant (build.ISAS; default: $KVBOOST_NATIVE_ISA, else the best this CPU runs)."""
    reason = unsupported_reason(adapter)
    if reason is not None:
        return None, reason
    lib, reason = build.load(isa)
    if lib is None:
        return None, reason
    try:
        return NativeDecoder(adapter, lib, threads or torch.get_num_threads()), None
    except NativeRefusal as refusal:
        return None, f"the native library refused the model: {refusal}"


def _step_error(code: int, rows: list[tuple]) -> Exception:
    """The error for kvb_decoder_rows' code (decode.cpp Decoder::step)."""
    if code == 2:
        return ValueError("a native step's row position out of range (0 .. 2^31): "
                          f"{[p for _, p, _, _ in rows if not 0 <= p < 1 << 31]}")
    if code == 3:
        return MemoryError(f"a native step's attention partials for {len(rows)} rows pass the 2^31 entries the library indexes")
    return MemoryError(f"the native step could not allocate its scratch memory for {len(rows)} rows")


def _longs(values) -> ctypes.Array:
    return (ctypes.c_int64 * len(values))(*values)
