"""Moved keys equal keys computed at the new position by the model's own rotary embedding."""
import sys

import pytest
import torch

from kvboost_engine.model.arch import SUPPORTED_ARCHITECTURES, ModelAdapter
from kvboost_engine.model.rope import RopeMover
from tiny_models import tiny_model

LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024}
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": [1.0 + 0.1 * i for i in range(4)], "long_factor": [2.0 + 0.5 * i for i in range(4)],
            "original_max_position_embeddings": 1024}
CASES = [
    ("llama", {"rope_type": "default", "rope_theta": 10000.0}),
    ("llama", {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    ("llama", {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
    ("llama", LLAMA3),
    ("llama", YARN),
    ("qwen2", {"rope_type": "default", "rope_theta": 1000000.0}),
    ("qwen2", YARN),
    ("mistral", {"rope_type": "default", "rope_theta": 10000.0}),
    ("qwen3", {"rope_type": "default", "rope_theta": 1000000.0}),
    ("phi3", {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    ("phi3", LONGROPE),
]


def rotate_with_model(model, keys, start):
    positions = torch.arange(start, start + keys.shape[2])[None]
    cos, sin = model.model.rotary_emb(keys, positions)
    apply = sys.modules[type(model).__module__].apply_rotary_pos_emb
    return apply(keys, keys, cos, sin)[1]


@pytest.mark.parametrize("model_type, rope", CASES, ids=[f"{m}-{r['rope_type']}" for m, r in CASES])
def test_moved_keys_match_keys_rotated_at_new_position(model_type, rope):
    extra = {"original_max_position_embeddings": 1024} if model_type == "phi3" else {}
    model = tiny_model(model_type, rope_parameters=rope, **extra)
    mover = RopeMover(ModelAdapter(model))
    torch.manual_seed(1)
    raw = torch.randn(1, 2, 50, ModelAdapter(model).geometry.head_dim)
    limit = 1000 if mover.exact_limit else 4000
    for old, new in ((5, limit - 60), (limit - 60, 3), (700, 701)):
        cached = rotate_with_model(model, raw, old)
        expected = rotate_with_model(model, raw, new)
        moved = mover.move(cached.clone(), old, new)
        assert (moved - expected).abs().max() < 1e-5, (old, new)


def test_length_dependent_rope_refuses_beyond_original_window():
    model = tiny_model("phi3", rope_parameters=LONGROPE, original_max_position_embeddings=1024)
    mover = RopeMover(ModelAdapter(model))
    assert mover.can_move(1023) and not mover.can_move(1024)
    assert RopeMover(ModelAdapter(tiny_model("llama"))).can_move(4000)


@pytest.mark.skipif("gemma3_text" not in SUPPORTED_ARCHITECTURES, reason="Gemma 3 needs transformers 5")
def test_gemma3_moves_each_layer_with_its_own_frequencies():
    """Sliding-window layers (base 1e4) and global layers (base 1e6) each match the model's rotary
    for their own layer type; using one set for all layers would be off by far more."""
    model = tiny_model("gemma3_text")
    adapter = ModelAdapter(model)
    mover = RopeMover(adapter)
    assert mover.per_layer and mover.can_move(10**6)
    layers, kv_heads, dim = adapter.geometry.num_layers, adapter.geometry.kv_heads, adapter.geometry.head_dim
    torch.manual_seed(2)
    raw = torch.randn(layers, kv_heads, 40, dim) * 4                    # [layers, kv_heads, n, D]
    apply = sys.modules[type(model).__module__].apply_rotary_pos_emb

    def at(start):
        positions = torch.arange(start, start + raw.shape[2])[None]
        out = torch.empty_like(raw)
        for layer, kind in enumerate(adapter.layer_rope_kinds):
            cos, sin = model.model.rotary_emb(raw, positions, kind)
            out[layer] = apply(raw[layer][None], raw[layer][None], cos, sin)[1][0]
        return out

    for old, new in ((0, 37), (5, 900), (1000, 3), (17, 18)):
        moved = mover.move(at(old).clone(), old, new)
        expected = at(new)
        # relative to the keys' size (|k| up to ~20 here): fp32 rounding of the rotation itself
        assert ((moved - expected).abs().max() / expected.abs().max()) < 1e-6, (old, new)
    assert (mover.kinds["sliding_attention"].rotate(at(0), 0, 900) - at(900)).abs().max() > 1e-2
    with pytest.raises(ValueError, match="layers"):
        mover.move(at(0)[:1].clone(), 0, 5)
