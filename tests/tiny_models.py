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
    # Gemma 3: window 16 (prompts here run past it), every third layer global with its own base;
    # head_dim != hidden / heads and query_pre_attn_scalar != head_dim so a wrong scaling shows;
    # a small final softcap so random logits are visibly capped
    "gemma3_text": dict(num_hidden_layers=6, head_dim=32, query_pre_attn_scalar=64, sliding_window=16,
                        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                         "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}},
                        final_logit_softcapping=0.5, attn_logit_softcapping=None, tie_word_embeddings=True,
                        pad_token_id=0, bos_token_id=2, eos_token_id=1),
}
# architectures whose norms scale by (1 + weight) and start at weight 0: randomised so they matter
_ZERO_INIT_NORMS = ("gemma3_text",)


def tiny_model(model_type: str, seed: int = 0, **overrides):
    """A randomly initialised fp32 model of `model_type` with a 49152-token vocabulary."""
    settings = {**BASE, **ARCH_CONFIGS.get(model_type, {}), **overrides}
    config = AutoConfig.for_model(model_type, **compat.config_settings(settings, model_type))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if model_type in _ZERO_INIT_NORMS:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.normal_(0, 0.3)
    return model.eval()
