"""Every architecture in the support table runs through our layer loop exactly like HF does."""
import pytest
import torch

from kvboost_engine import Engine
from kvboost_engine.model.arch import SUPPORTED_ARCHITECTURES
from tiny_models import tiny_model


@pytest.mark.parametrize("model_type", sorted(SUPPORTED_ARCHITECTURES))
def test_tiny_model_matches_transformers_and_cache_is_exact(model_type, smol):
    tokenizer = smol[1]
    model = tiny_model(model_type)
    warm = Engine(model, tokenizer, cache_bytes=64 * 2**20)
    cold = Engine(model, tokenizer, cache_bytes=0)
    prompt = "A tiny random model reads this sentence and then continues it somehow. " * 3
    ids = warm.encode_prompt(prompt).token_ids
    with torch.inference_mode():
        reference = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
        hf_logits = model(torch.tensor([ids])).logits[0, -1]
    assert cold.generate(prompt, max_new_tokens=12, min_new_tokens=12).token_ids == reference
    first = warm.generate(prompt, max_new_tokens=12, min_new_tokens=12)
    longer = prompt + "And one more sentence."
    second = warm.generate(longer, max_new_tokens=12, min_new_tokens=12)
    assert first.token_ids == reference
    assert second.reused_tokens > len(ids) - 2
    assert second.token_ids == cold.generate(longer, max_new_tokens=12, min_new_tokens=12).token_ids
    assert torch.allclose(cold.next_token_logits(prompt), hf_logits, atol=1e-4)


def test_sliding_window_matches_transformers(smol):
    tokenizer = smol[1]
    model = tiny_model("mistral", sliding_window=16)
    model.config._attn_implementation = "sdpa"
    prompt = "Sliding windows only look back a little way in the text. " * 4
    engine = Engine(model, tokenizer, cache_bytes=64 * 2**20)
    ids = engine.encode_prompt(prompt).token_ids
    model.set_attn_implementation("eager")
    with torch.inference_mode():
        reference = model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)[0, len(ids):].tolist()
    engine = Engine(model, tokenizer, cache_bytes=64 * 2**20)
    assert engine.generate(prompt, max_new_tokens=10, min_new_tokens=10).token_ids == reference
    assert engine.generate(prompt + " More.", max_new_tokens=10, min_new_tokens=10).reused_tokens > 0


@pytest.mark.parametrize("model_type", ["mistral", "phi3"])
def test_a_mistral_or_phi3_config_with_layer_types_slides_every_layer_as_transformers(model_type, smol):
    """HF's Mistral and Phi-3 masks use config.sliding_window in every layer whatever `layer_types` says
    (transformers warns about it); ours followed layer_types (0.05-0.08 off in the logits)."""
    model = tiny_model(model_type, sliding_window=16, layer_types=["full_attention", "sliding_attention"])
    engine = Engine(model, smol[1], cache_bytes=0)
    assert engine.adapter.layer_windows == (16, 16)
    prompt = "Sliding windows only look back a little way in the text. " * 4
    ids = engine.encode_prompt(prompt).token_ids
    with torch.inference_mode():
        reference = model(torch.tensor([ids])).logits[0, -1]
    assert float((engine.next_token_logits(prompt) - reference).abs().max()) < 1e-4
