"""The model fingerprint: what seeds every cache key, so KV of one model never serves another.

The weights are identified by every byte of every tensor (xxh3-128, tensors hashed in parallel
threads: xxhash releases the GIL), or, for a checkpoint kvboost loaded itself without holding
all of it (AWQ, layer streaming), by that checkpoint's own full content hash
(`quantization_config["weights_digest"]`). Then the config (dtype, quantization), the rope
settings and the tokenizer (its whole serialized form: vocabulary, merges, normalizer, added and
special tokens; and the chat template).

Cost at load, SmolLM2-135M-Instruct in fp32 (538 MB of tensors, tied embeddings hashed once;
`python -m benchmarks.micro.fingerprint`), on the 2-core development machine shared with other
work (load average 6): 0.29 s for the tensors (1.9 GB/s), 0.10 s for the tokenizer; building an
Engine took 0.36 s, against 0.016 s with the old fingerprint (4 KiB sampled at each end of each
tensor). Under heavier load (15-19) it took 0.55-1.8 s. xxh3 runs at memory speed, so a quiet
machine with more cores takes a fraction of that.
"""
from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import torch
import xxhash

_COPY_BYTES = 64 << 20          # tensors off the CPU are copied to host memory this much at a time


def model_fingerprint(model: torch.nn.Module, rope_settings: dict, tokenizer=None) -> bytes:
    """16 bytes identifying the weights (all their bytes), dtype, config, rope, quantization and
    tokenizer of a model."""
    h = xxhash.xxh3_128()
    config = model.config
    settings = {k: v for k, v in config.to_diff_dict().items() if k not in ("_name_or_path", "_commit_hash")}
    h.update(json.dumps(settings, sort_keys=True, default=str).encode())
    h.update(json.dumps(rope_settings, sort_keys=True, default=str).encode())
    quantization = getattr(config, "quantization_config", None)
    h.update(repr(quantization).encode())
    checkpoint_digest = quantization.get("weights_digest") if isinstance(quantization, dict) else None
    with ThreadPoolExecutor(max_workers=_workers()) as pool:
        tokenizer_part = pool.submit(tokenizer_digest, tokenizer)       # overlaps the tensors
        if checkpoint_digest:
            h.update(f"checkpoint:{checkpoint_digest}".encode())
        else:
            h.update(weights_digest(model, pool=pool))
        h.update(tokenizer_part.result())
    return h.digest()


def _workers() -> int:
    return min(8, os.cpu_count() or 1)


def weights_digest(model: torch.nn.Module, threads: int | None = None, pool: ThreadPoolExecutor | None = None) -> bytes:
    """xxh3-128 over the names, shapes, dtypes and all bytes of every tensor of the state dict,
    tensors hashed by `threads` threads (or on `pool`). A tensor shared under two names (tied
    embeddings) is hashed once and named as an alias."""
    named = sorted(model.state_dict().items())
    first_name: dict[tuple, str] = {}
    labels, unique = [], []
    for name, tensor in named:
        ident = (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))
        if tensor.numel() and tensor.device.type != "meta" and ident in first_name:
            labels.append(f"{name}={first_name[ident]}")
            continue
        first_name.setdefault(ident, name)
        labels.append(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}")
        unique.append(tensor)
    if pool is not None:
        digests = list(pool.map(tensor_digest, unique))
    else:
        with ThreadPoolExecutor(max_workers=threads or _workers()) as own:
            digests = list(own.map(tensor_digest, unique))
    h = xxhash.xxh3_128()
    h.update("\n".join(labels).encode())
    for digest in digests:
        h.update(digest)
    return h.digest()


def tensor_digest(tensor: torch.Tensor) -> bytes:
    """xxh3-128 of a tensor's bytes in C order (copied to the host in pieces when it is elsewhere)."""
    h = xxhash.xxh3_128()
    if not tensor.numel() or tensor.device.type == "meta":
        return h.digest()
    flat = tensor.detach().reshape(-1).view(torch.uint8)
    if flat.device.type == "cpu":
        h.update(flat.numpy())
        return h.digest()
    for start in range(0, flat.numel(), _COPY_BYTES):
        h.update(flat[start:start + _COPY_BYTES].cpu().numpy())
    return h.digest()


def tokenizer_digest(tokenizer) -> bytes:
    """xxh3-128 of what decides the token ids and the prompt text: a fast tokenizer's serialized
    backend (else its vocabulary), special tokens and chat template."""
    if tokenizer is None:
        return b"no tokenizer"
    h = xxhash.xxh3_128()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps(getattr(tokenizer, "special_tokens_map", {}), sort_keys=True, default=str).encode())
    h.update(repr(getattr(tokenizer, "chat_template", None)).encode())
    h.update(repr((getattr(tokenizer, "add_bos_token", None), getattr(tokenizer, "add_eos_token", None))).encode())
    return h.digest()
