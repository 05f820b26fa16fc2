"""Building an engine's parts from a model and its options (the engine itself only wires them up)."""
from __future__ import annotations

import logging
import os
import tempfile

import torch
import xxhash

from .config import EngineConfig
from .errors import BudgetError, InputError
from .kv.codec import Int8Codec
from .kv.pool import BlockPool
from .model.arch import ModelAdapter
from .request.exit import flushed_at_exit

log = logging.getLogger(__name__)


def pool_for(config: EngineConfig, adapter: ModelAdapter, disk=None) -> BlockPool:
    """The KV block pool: `kv_pool_bytes`, else the cache budget plus two full-window requests.

    Refused with BudgetError before allocating when it is larger than the memory of its device.
    With a disk tier, a request longer than the pool spills to a file beside it; when the tier's
    directory is read-only the spill file goes to the temp dir (a warning), and if that fails too,
    spilling is off (a warning).
    """
    per_request = adapter.context_window * adapter.geometry.bytes_per_token
    running = 2 * per_request if config.paged else 0    # contiguous requests bring their own buffers
    device = torch.device(config.kv_device) if config.kv_device else adapter.device
    if config.kv_pool_bytes is not None:
        ram = config.kv_pool_bytes
        check_fits_device(ram, device)
    else:
        ram = _derived_pool_bytes(config.cache_bytes + running, device)
    pin = device.type == "cpu" and adapter.device.type == "cuda"      # fast, async-capable copies
    spill_dir = _spill_dir(config, disk)
    if spill_dir is not None:
        try:
            return BlockPool(adapter.geometry, ram, device, block_tokens=config.block_tokens,
                             spill_dir=spill_dir, spill_bytes=per_request, pin_memory=pin)
        except OSError as error:
            log.warning("kvboost: cannot create the KV spill file in %s (%s): spilling is off, requests "
                        "longer than the pool are refused", spill_dir, error)
    return BlockPool(adapter.geometry, ram, device, block_tokens=config.block_tokens, pin_memory=pin)


def _spill_dir(config: EngineConfig, disk) -> str | None:
    if not config.disk_cache_dir:
        return None
    if disk is not None and disk.read_only:
        fallback = tempfile.gettempdir()
        log.warning("kvboost: %s is read-only: the KV spill file goes to %s", config.disk_cache_dir, fallback)
        return fallback
    return os.path.join(config.disk_cache_dir, "spill")


def device_memory_bytes(device: torch.device) -> int | None:
    """Physical memory of a device (RAM for the CPU), or None where it cannot be told."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type != "cpu":
        return None
    try:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None
    return pages * page_size if pages > 0 and page_size > 0 else None


def check_fits_device(nbytes: int, device: torch.device) -> None:
    """BudgetError when a pool of `nbytes` exceeds the physical memory of `device` (before allocating)."""
    total = device_memory_bytes(device)
    if total is not None and nbytes > total:
        raise BudgetError(f"kv_pool_bytes={nbytes} is more than the {total} bytes of memory of the "
                          f"{device.type} device it would live on; choose a smaller kv_pool_bytes")


def _derived_pool_bytes(wanted: int, device: torch.device) -> int:
    """The default pool (cache_bytes plus two full-window requests), at most half the device's memory."""
    total = device_memory_bytes(device)
    if total is not None and wanted > total // 2:
        log.warning("kvboost: the default KV pool (cache_bytes plus two full-window requests, %d bytes) is "
                    "capped at half of the %s device's %d bytes; set kv_pool_bytes to choose", wanted,
                    device.type, total)
        return total // 2
    return wanted


def cache_budget(config: EngineConfig, pool: BlockPool) -> int:
    """`cache_bytes`, clamped to what the pool holds (cached chunks live in the pool)."""
    pool_bytes = pool.ram_blocks * pool.block_bytes
    if config.cache_bytes > pool_bytes:
        if config.kv_pool_bytes is not None:
            log.warning("cache_bytes=%d is larger than the KV pool (kv_pool_bytes=%d, %d bytes of whole "
                        "blocks): the cache may hold at most the pool", config.cache_bytes, config.kv_pool_bytes,
                        pool_bytes)
        return pool_bytes
    return config.cache_bytes


def kv_fingerprint(fingerprint: bytes, adapter: ModelAdapter) -> bytes:
    """The cache's fingerprint: the model's, with the KV dtype mixed in where it is not the model's
    (KV rounded to bfloat16 is never served to an engine that keeps float32 KV, nor the reverse)."""
    if adapter.geometry.dtype == adapter.dtype:
        return fingerprint
    return xxhash.xxh3_128_digest(fingerprint + f"kv:{adapter.geometry.dtype}".encode())


def disk_tier_for(config: EngineConfig, fingerprint: bytes, native, adapter: ModelAdapter):
    """The disk tier, or None. Its folder is keyed by what computed the KV too: the native step's
    instruction-set variant and prefill, or the PyTorch path on its device (their KV differ in the
    last bits, so a folder shared by machines or settings never serves one the other's KV as exact)."""
    if not config.disk_cache_dir:
        return None
    from .kv.disk import DiskTier
    if native is not None:
        kernel = f"native:{native.isa}:{native.native_prefill}:{native.int8_queries}"
    else:
        kernel = f"torch:{adapter.device.type}"
    fingerprint = xxhash.xxh3_128_digest(fingerprint + kernel.encode() + b"int8" * config.disk_kv_int8)
    return DiskTier(config.disk_cache_dir, config.disk_cache_bytes, fingerprint)


def disk_codec_for(config: EngineConfig, adapter: ModelAdapter):
    return Int8Codec(adapter.geometry) if config.disk_kv_int8 else None


def flush_at_exit(tier):
    """Flush the tier's pending writes at interpreter exit, after the schedulers stop (request/exit.py:
    their last steps store chunks too); returns the function that cancels it (the engine closed first)."""
    flushed_at_exit.add(tier)
    return lambda: flushed_at_exit.discard(tier)


def release_closed(owned_model, native, pool, idle: bool) -> None:
    """What a closed engine opened, given back: the layer streamer of a model it loaded itself (`owned_model`);
    once its scheduler thread has ended (`idle`: not closed from inside a step), the KV pool's memory and
    spill file and the native step's memory (a closed engine kept referenced held them all)."""
    streamer = getattr(owned_model, "kvboost_streamer", None)
    if streamer is not None:
        streamer.close()
    if idle:
        if native is not None:
            native.close()
        pool.free_storage()


def check_device(device) -> torch.device:
    """`device` (None: CUDA where available, else the CPU) as a torch.device, before anything loads:
    InputError for a name torch does not know or a CUDA device this machine lacks."""
    if device is None or device == "":        # "" as an unset DEVICE= gives it
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as err:
        raise InputError(f"device must be 'cpu', 'cuda', 'cuda:N' or a torch.device, got {device!r}") from err
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        raise InputError(f"device {str(device)!r}: this machine has no such CUDA device (torch sees "
                         f"{torch.cuda.device_count() if torch.cuda.is_available() else 0})")
    return device


def resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise InputError(f"dtype must be one of {', '.join(names)} or a torch.dtype, got {dtype!r}")
    return names[dtype]


# llama.cpp's end-of-generation token texts (llama-vocab.cpp, those of the architectures we run): a special
# token with one of them ends a reply as the configured eos does (a GGUF stores one eos id: Gemma 3's
# <eos>, SmolLM2's <|im_end|>; llama.cpp ends at <end_of_turn> and <|endoftext|> too)
END_TEXTS = frozenset({"<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                       "<|end_of_text|>", "<EOT>", "<end_of_utterance>"})


def eos_ids(model, tokenizer) -> frozenset:
    """The token ids that end a reply: the configured eos (generation config, config, tokenizer) and the
    tokenizer's special tokens of END_TEXTS."""
    ids = {int(i) for i, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()
           if getattr(token, "special", False) and getattr(token, "content", None) in END_TEXTS}
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(int(e) for e in eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def logits_size(model, tokenizer) -> int:
    """Length of the model's logits: the output embedding's rows, else the configured vocabulary."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[0])
    config = getattr(model.config, "text_config", None) or model.config
    return int(getattr(config, "vocab_size", None) or getattr(model.config, "vocab_size", None) or len(tokenizer))


def weight_stats(model) -> dict:
    """Weight-format, AWQ loading and layer-streaming telemetry, when the model has them."""
    out = {}
    converted = getattr(model, "kvboost_weights", None)
    if converted is not None:
        out.update(converted.as_dict())
    info = getattr(model, "kvboost_awq", None)
    if info is not None:
        out.update(info.as_dict())
    streamer = getattr(model, "kvboost_streamer", None)
    if streamer is not None:
        out.update(streamer.telemetry())
    packed = getattr(model, "kvboost_packed", None)
    if packed is not None:
        out.update(weights_format=packed.get("format", "gguf"), weights_gguf=packed["gguf"],
                   weights_cache_dir=packed["dir"], weights_requantized_error=packed["requantized_error"])
    from .weights.memory import weight_memory
    out.update(weight_memory(model))
    return out


def native_decoder_for(config: EngineConfig, adapter: ModelAdapter):
    """(the native decode step, None) per `native_decode`, or (None, why it is off).

    InputError when native_decode=True and it cannot run here."""
    if config.native_decode is False:
        return None, "off (native_decode=False)"
    from .native.decoder import native_decoder
    decoder, reason = native_decoder(adapter)
    if decoder is None and config.native_decode:
        raise InputError(f"native_decode=True, but the native decode step cannot run: {reason}")
    return decoder, reason


def native_stats(decoder, reason: str | None, fallbacks: dict | None = None) -> dict:
    """stats()'s native entries: whether the native step runs, its instruction-set variant
    (native_isa), and why it is off (native_decode_off); whether prompt chunks run natively
    (native_prefill) and why not (native_prefill_off); whether one-row attention asks for KV rows
    ahead (native_kv_ahead, decoder.kv_ahead); whether int8 keys are scored against int8 queries
    (native_int8_queries, decoder.int8_queries); the steps of one sequence (a token or a prompt
    chunk) that took the PyTorch layer loop all the same, by reason (native_fallback_steps,
    Forward.fallbacks: KV blocks spilled to disk, ...)."""
    if decoder is None:
        return {"native_decode": False, "native_isa": None, "native_decode_off": reason}
    out = {"native_decode": True, "native_isa": decoder.isa, "native_prefill": decoder.native_prefill,
           "native_kv_ahead": decoder.kv_ahead, "native_int8_queries": decoder.int8_queries,
           "native_fallback_steps": dict(fallbacks or {})}
    if not decoder.native_prefill:
        out["native_prefill_off"] = decoder.prefill_off
    return out
