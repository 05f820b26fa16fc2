"""Content hashes: model fingerprint and prefix keys (xxh3-128 over token ids)."""
from __future__ import annotations

import json
from array import array

import torch
import xxhash

_SAMPLE_BYTES = 4096


def model_fingerprint(model: torch.nn.Module, rope_settings: dict) -> bytes:
    """16 bytes identifying weights, dtype, rope config and quantization of a model.

    Weights are identified by name, shape, dtype and the first and last bytes of every
    tensor: cheap (no full pass over the weights) yet different for any two real checkpoints.
    """
    h = xxhash.xxh3_128()
    config = model.config
    settings = {k: v for k, v in config.to_diff_dict().items() if k not in ("_name_or_path", "_commit_hash")}
    h.update(json.dumps(settings, sort_keys=True, default=str).encode())
    h.update(json.dumps(rope_settings, sort_keys=True, default=str).encode())
    h.update(repr(getattr(config, "quantization_config", None)).encode())
    for name, tensor in sorted(model.state_dict().items()):
        h.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        flat = tensor.detach().reshape(-1)
        raw = flat.contiguous().view(torch.uint8) if flat.numel() else flat.to(torch.uint8)
        h.update(raw[:_SAMPLE_BYTES].cpu().numpy().tobytes())
        h.update(raw[-_SAMPLE_BYTES:].cpu().numpy().tobytes())
    return h.digest()


def token_bytes(token_ids) -> bytes:
    return array("i", token_ids).tobytes()


class PrefixHasher:
    """Running hash of a token prefix: `key()` after any number of tokens is boundary-independent,
    so a prefix has the same key however it was cut into chunks."""

    __slots__ = ("_h",)

    def __init__(self, fingerprint: bytes):
        self._h = xxhash.xxh3_128()
        self._h.update(fingerprint)

    def update(self, token_ids) -> None:
        self._h.update(token_bytes(token_ids))

    def key(self) -> bytes:
        return self._h.digest()
