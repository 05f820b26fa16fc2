"""Tiny random models of each supported architecture (seconds to build, no download)."""
from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from kvboost_engine.model import compat

BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096, vocab_size=49152, tie_word_embeddings=False)

ARCH_CONFIGS = {
    "llama": dict(),
    "mistral": dict(sliding_window=None),
    "qwen2": dict(),
    "qwen3": dict(head_dim=16),
    "phi3": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                 pad_token_id=0),
}


def tiny_model(model_type: str, seed: int = 0, **overrides):
    """A randomly initialised fp32 model of `model_type` with a 49152-token vocabulary."""
    settings = {**BASE, **ARCH_CONFIGS.get(model_type, {}), **overrides}
    config = AutoConfig.for_model(model_type, **compat.config_settings(settings, model_type))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()
