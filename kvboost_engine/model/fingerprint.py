"""The model fingerprint: what seeds every cache key, so KV of one model never serves another."""
from __future__ import annotations

import json

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
