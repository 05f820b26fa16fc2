"""Tiny AWQ checkpoints for tests: a random tiny model quantized by our producer (seconds)."""
from __future__ import annotations

from pathlib import Path

import torch

from kvboost_tools.awq.quantize import calibration_ids, quantize_model, save_checkpoint
from kvboost_engine.loading import default_model_dir
from tiny_models import tiny_model


def write_tiny_awq(out: Path, model_type: str = "llama", group_size: int = 32, search: bool = True,
                   **overrides) -> torch.nn.Module:
    """Quantize a tiny random `model_type` into `out` (with the default tokenizer); return the float model."""
    from transformers import AutoTokenizer

    model = tiny_model(model_type, **overrides)
    reference = tiny_model(model_type, **overrides)
    ids = calibration_ids(AutoTokenizer.from_pretrained(default_model_dir()), 4, 64) if search else None
    state = quantize_model(model, ids, group_size)
    save_checkpoint(model, state, out, group_size, default_model_dir())
    return reference
