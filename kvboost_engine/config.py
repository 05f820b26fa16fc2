"""Engine options: one slotted dataclass, validated once."""
from __future__ import annotations

import dataclasses
import difflib
import numbers
import operator
import os
from dataclasses import dataclass

from .errors import InputError

DEFAULT_CACHE_BYTES = 2 * 1024**3
DEFAULT_CHUNK_TOKENS = 256
MOVED_STRATEGIES = ("blend", "none", "full")
MOVED_SELECTIONS = ("deviation", "attention")
DEFAULT_DISK_BYTES = 8 * 1024**3
KV_DEVICES = (None, "cpu")
KV_DTYPES = (None, "float32", "bfloat16", "float16", "int8")


@dataclass(slots=True, frozen=True)
class EngineConfig:
    """Options fixed for the life of an engine.

    cache_bytes: byte budget of the reusable KV cache; 0 turns reuse off (same code path,
        nothing stored), which is the baseline for every comparison.
    chunk_tokens: longest chunk stored as one cache node; segments longer than this are cut.
    reply_memo_entries: how many recent replies remember the exact token ids the model
        generated, so the next turn's prompt re-uses those ids instead of re-tokenizing (opt-in:
        0, the default, tokenizes a reply's text as any engine does, so a chat's next turn is the
        same prompt in every engine, process and replica; with a memo, a reply whose text
        tokenizes otherwise (about one in eight on the default model) reuses all its KV, but the
        next turn's prompt, and so its reply, then depends on this engine's history).
    moved_reuse: what to do with documents / plain text found cached at another position:
        "full" (default) recomputes them (exact-prefix reuse only: replies identical to no cache);
        "blend" (opt-in, approximate) re-rotates their keys and recomputes the `recompute_ratio`
        share of moved tokens: first the `recompute_head_tokens` first tokens of each moved span,
        then those whose KV deviates most at `check_layer`: faster, but it changes some answers (the
        README gives the measured cost, per warm-up regime, and the frontier these defaults come
        from: 16 head tokens kept more or as many answers as 4 in 5 of 6 model-regime pairs, at the
        same cost); "none" re-rotates only.
    moved_window_rule: on models with sliding-window layers (window W), the first W - 1 tokens of
        a moved span, whose windows reach into the text before it, are computed instead of moved,
        and spans of at most W - 1 tokens are not moved at all. False moves whole spans (their
        window layers then keep KV computed after other text): approximate, for measurements.
    moved_selection: how "blend" chooses the moved tokens to recompute: "deviation" (CacheBlend:
        the KV that changes most when recomputed at `check_layer`) or "attention" (ProphetKV-style:
        the tokens the new tokens attend to most over the first check_layer + 1 layers, measured by a
        probe pass of the new tokens over the moved KV).
    paged: keep each request's KV as a block table over a shared pool (default on CPU): cached
        prefixes are mapped without copying. False: one contiguous buffer per request.
    prefill_chunk_tokens: longest run of new prompt tokens computed in one forward (bounds
        activation memory; other requests' decode steps interleave between runs).
    block_tokens: positions per pool block.
    kv_pool_bytes: RAM for all KV, cached chunks and running requests together (default:
        cache_bytes plus two requests at the full context window). A request that cannot get
        its KV even after evicting cached chunks is refused before any work.
    disk_cache_dir / disk_cache_bytes: a disk tier: cached chunks are written there (checksummed,
        atomic), found again after eviction or a restart, and requests longer than the pool
        spill to a file there instead of being refused.
    kv_device: None (default): KV lives on the model's device. "cpu": KV pages live in CPU RAM
        (pinned when the model is on CUDA) and attention runs there, while the weights stay on
        the model's device; only q/k/v and attention outputs cross the bus. For contexts whose KV
        does not fit on the GPU. Implies paged KV.
    kv_dtype: the element type KV is kept in (the pool, the contiguous buffers, the disk tier):
        None (default) the model's dtype; "bfloat16" or "float16" halve a float32 model's KV memory
        and the bytes attention reads per step (llama.cpp keeps f16 KV by default). Keys and values
        are rounded (to nearest even) when written and computed with in the model's dtype when read,
        by every path alike, so reuse on the native step stays token-exact: a request with and
        without cache attends over the same rounded KV (logits bit for bit). On the PyTorch path a
        key from a prefill's product and a decode step's can round apart: float16 within ~1e-2 on
        the logits, bfloat16 and int8 more (a greedy reply can change). The rounding
        changes the numbers against float32 KV (the README gives the measured effect). Mixed into
        the cache fingerprint: disk entries of one KV dtype are never read by an engine of another.
        "int8": a quarter of float32 KV memory (8.5 bits a value: int8 codes per block of 32 with a
        float16 scale each, llama.cpp's q8_0; kv/element.py), for long contexts and many concurrent
        chats; the values change more than with 16 bits (the README gives the measured perplexity),
        and reuse as exact as above (the native step's). Needs a head_dim that is a multiple of 32.
    native_decode: a step (decode rows of every running sequence, or a prompt chunk) as one call
        into native code (kvboost_engine/native: every layer in AVX-512, AVX-VNNI or AVX2 kernels,
        no PyTorch op per norm or projection), for float32 models, models converted with
        weights="int4" or "int8" and GGUF files as stored (Llama, Mistral, Qwen2, Qwen3, Gemma 3 layouts, on
        CPU). None (default): on where it can run (x86-64 Linux, AVX2 with FMA and F16C, a C++
        compiler for the one-time build), else the PyTorch layer loop; True: required (InputError
        with the reason where it cannot run); False: off. In float32 it is the same arithmetic in another order of
        additions; with int4 it quantizes activations to int8 per block of 32, so its replies can
        differ from the PyTorch int4 path's. Engine.stats() says whether it runs and why not.
    max_running: most requests decoding or prefilling at once in the engine's batch (continuous
        batching: every step is one forward over all of them).
    max_batch_tokens: most tokens one batch step computes (decode tokens plus prompt chunks);
        None: the larger of prefill_chunk_tokens and max_running (so a prompt being prefilled always
        gets tokens next to max_running - 1 decoding requests). Bounds how long a long prompt holds
        the others' decoding.
    max_waiting, queue_timeout_s: requests waiting for a running slot or KV room beyond the free
        slots (beyond max_waiting a request is refused with a BudgetError at once; after waiting
        queue_timeout_s it gets one; one that cannot fit the pool even alone is refused at once).
    disk_kv_int8: store chunks on disk as int8 (per-channel keys, per-token values): about a
        quarter of fp32 on disk and to read; chunks read back are approximations (inexact).
    """

    cache_bytes: int = DEFAULT_CACHE_BYTES
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    reply_memo_entries: int = 0
    moved_reuse: str = "full"
    recompute_ratio: float = 0.15
    recompute_head_tokens: int = 16
    check_layer: int = 1
    moved_window_rule: bool = True
    moved_selection: str = "deviation"
    paged: bool | None = None
    prefill_chunk_tokens: int = 1024
    block_tokens: int = 16
    kv_pool_bytes: int | None = None
    disk_cache_dir: str | None = None
    disk_cache_bytes: int = DEFAULT_DISK_BYTES
    disk_kv_int8: bool = False
    kv_device: str | None = None
    kv_dtype: str | None = None
    native_decode: bool | None = None
    max_running: int = 16
    max_batch_tokens: int | None = None
    max_waiting: int = 1024
    queue_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        for name in _INT_MINIMUM:
            self._normalise_int(name)
        if self.moved_reuse not in MOVED_STRATEGIES:
            raise InputError(f"moved_reuse must be one of {', '.join(MOVED_STRATEGIES)}, got {self.moved_reuse!r}")
        if not _real(self.recompute_ratio) or not 0 <= self.recompute_ratio <= 1:
            raise InputError(f"recompute_ratio must be a number in [0, 1], got {self.recompute_ratio!r}")
        if self.moved_selection not in MOVED_SELECTIONS:
            raise InputError(f"moved_selection must be one of {', '.join(MOVED_SELECTIONS)}, got {self.moved_selection!r}")
        for name in ("paged", "disk_kv_int8", "native_decode", "moved_window_rule"):
            value = getattr(self, name)
            if not isinstance(value, bool) and not (name in ("paged", "native_decode") and value is None):
                allowed = "None, True or False" if name in ("paged", "native_decode") else "True or False"
                raise InputError(f"{name} must be {allowed}, got {value!r}")
        if self.disk_cache_dir is not None:
            if not isinstance(self.disk_cache_dir, (str, os.PathLike)) or not os.fspath(self.disk_cache_dir):
                raise InputError(f"disk_cache_dir must be None or a path, got {self.disk_cache_dir!r}")
            object.__setattr__(self, "disk_cache_dir", os.path.expanduser(os.fspath(self.disk_cache_dir)))
        for name in ("recompute_ratio", "queue_timeout_s"):
            if _real(getattr(self, name)):
                object.__setattr__(self, name, float(getattr(self, name)))      # a numpy float as a float
        if self.kv_device not in KV_DEVICES:
            raise InputError(f"kv_device must be None or 'cpu', got {self.kv_device!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise InputError(f"kv_dtype must be None, 'float32', 'bfloat16', 'float16' or 'int8', got {self.kv_dtype!r}")
        if self.kv_dtype == "int8" and self.disk_kv_int8:
            raise InputError("disk_kv_int8 re-quantizes float KV for the disk tier; with kv_dtype='int8' the KV "
                             "is int8 already and goes to disk as it is: leave disk_kv_int8 off")
        if self.kv_device == "cpu" and self.paged is False:
            raise InputError("kv_device='cpu' keeps KV in CPU pages: it needs paged KV (paged=None or True)")
        if self.max_batch_tokens is not None and self.max_batch_tokens < self.max_running:
            raise InputError(f"max_batch_tokens must be None or an int >= max_running ({self.max_running}), "
                             f"got {self.max_batch_tokens!r}")
        if not _real(self.queue_timeout_s) or not 0 <= self.queue_timeout_s < float("inf"):
            raise InputError(f"queue_timeout_s must be a finite number >= 0, got {self.queue_timeout_s!r}")

    def _normalise_int(self, name: str) -> None:
        """Check an integer option (ints and integer-like objects such as numpy ints; no bools,
        floats or strings) against its minimum, and store it as a plain int."""
        value = getattr(self, name)
        minimum = _INT_MINIMUM[name]
        if value is None and name in _OPTIONAL_INTS:
            return
        try:
            number = None if isinstance(value, bool) else operator.index(value)
        except TypeError:
            number = None
        if number is None or number < minimum:
            optional = "None or " if name in _OPTIONAL_INTS else ""
            raise InputError(f"{name} must be {optional}an int >= {minimum}, got {value!r}")
        object.__setattr__(self, name, number)


# integer options and their smallest allowed value
_INT_MINIMUM = {"cache_bytes": 0, "chunk_tokens": 1, "reply_memo_entries": 0, "recompute_head_tokens": 0,
                "check_layer": 0, "prefill_chunk_tokens": 1, "block_tokens": 1, "kv_pool_bytes": 0,
                "disk_cache_bytes": 0, "max_running": 1, "max_batch_tokens": 1, "max_waiting": 0}
# integer options that may also be None
_OPTIONAL_INTS = ("kv_pool_bytes", "max_batch_tokens")


def _real(value) -> bool:
    """A real number (int, float, numpy's; not a bool), not NaN."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and value == value


# Engine.from_pretrained's options beyond EngineConfig's fields (they choose how to load the model)
LOAD_OPTIONS = ("device", "dtype", "weights", "resident_layers", "resident_bytes", "stream_from", "staging_slots",
                "awq_kernel")


def closest_name(name: str, names) -> str | None:
    """The name in `names` closest to a misspelt `name` (difflib, 0.6 at least), or None."""
    return next(iter(difflib.get_close_matches(name, sorted(names), n=1, cutoff=0.6)), None)


def engine_config(config, options: dict) -> EngineConfig:
    """The EngineConfig an Engine runs with: `config`, or one built from `options`. InputError for
    both at once (the options were ignored), a `config` that is not an EngineConfig, and an option
    EngineConfig does not have (naming the closest, or Engine.from_pretrained for a load option)."""
    if config is not None:
        if not isinstance(config, EngineConfig):
            raise InputError(f"config must be an EngineConfig, got {type(config).__name__}")
        if options:
            raise InputError(f"pass config= or options ({', '.join(sorted(options))}), not both")
        return config
    fields = [f.name for f in dataclasses.fields(EngineConfig)]
    for name in options:
        if name in LOAD_OPTIONS:
            raise InputError(f"{name!r} chooses how the model loads: Engine.from_pretrained(..., {name}=...) takes it")
        if name not in fields:
            close = closest_name(name, fields)
            raise InputError(f"unknown engine option {name!r}" + (f"; did you mean {close!r}?" if close else ""))
    return EngineConfig(**options)
