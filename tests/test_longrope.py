"""longrope (Phi-3 128k): HF chooses its short or long factors by a call's length, so a prompt longer
than the original window is computed with the long ones from its first position. Prefilled in
chunks, every chunk takes the factors of the whole prompt (as HF's one call), and no KV crosses
between a prompt in one regime and a prompt in the other (cached = uncached, in both)."""
from __future__ import annotations

import pytest
import torch

from kvboost_engine import Engine
from kvboost_engine.loading import default_model_dir
from kvboost_engine.model import compat
from kvboost_engine.model.arch import SUPPORTED_ARCHITECTURES
from tiny_models import tiny_model

ORIGINAL = 48
ROPE = {"rope_theta": 10000.0, "rope_type": "longrope", "short_factor": [1.0] * 4,
        "long_factor": [4.0, 8.0, 16.0, 32.0], "original_max_position_embeddings": ORIGINAL}
TEXT = "A tiny random model reads this sentence and then continues it somehow. "


@pytest.fixture(scope="module")
def tokenizer():
    return compat.load_tokenizer(default_model_dir())


def _model(model_type: str):
    if model_type == "phi3":                                 # half of a head of 16 rotates: 4 frequencies
        rope = dict(ROPE, partial_rotary_factor=0.5)
    else:
        rope = dict(ROPE, short_factor=[1.0] * 8, long_factor=[2.0, 4.0, 4.0, 8.0, 8.0, 16.0, 16.0, 32.0])
    return tiny_model(model_type, rope_parameters=rope, original_max_position_embeddings=ORIGINAL)


@pytest.mark.parametrize("model_type", [t for t in ("phi3", "llama") if t in SUPPORTED_ARCHITECTURES])
def test_a_long_prompt_in_chunks_takes_the_long_factors_from_its_first_chunk(tokenizer, model_type):
    model = _model(model_type)
    engine = Engine(model, tokenizer, cache_bytes=0, prefill_chunk_tokens=16)
    prompt = TEXT * 4                                          # > ORIGINAL tokens, several chunks
    ids = engine.encode_prompt(prompt).token_ids
    assert len(ids) > ORIGINAL
    with torch.inference_mode():
        want = model(torch.tensor([ids])).logits[0, -1]
    got = engine.next_token_logits(prompt)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()     # 5e-3 off: short factors in early chunks


@pytest.mark.parametrize("model_type", [t for t in ("phi3", "llama") if t in SUPPORTED_ARCHITECTURES])
def test_no_kv_crosses_between_the_short_and_the_long_regime(tokenizer, model_type):
    model = _model(model_type)
    warm = Engine(model, tokenizer, cache_bytes=1 << 26, chunk_tokens=8)
    cold = Engine(model, tokenizer, cache_bytes=0)
    short, long = TEXT * 1, TEXT * 4                         # the same start; one under, one over the window
    assert len(warm.encode_prompt(short)) <= ORIGINAL < len(warm.encode_prompt(long))
    warm.generate(short, max_new_tokens=2)
    reply = warm.generate(long, max_new_tokens=4, min_new_tokens=4)
    assert reply.reused_tokens == 0                          # its short start was an exact hit before
    assert reply.token_ids == cold.generate(long, max_new_tokens=4, min_new_tokens=4).token_ids
    assert torch.equal(warm.next_token_logits(long), cold.next_token_logits(long))     # both computed whole
    got, want = warm.next_token_logits(short), cold.next_token_logits(short)        # reused, as before
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_a_long_prompt_cannot_be_pinned(tokenizer):
    """It is not cached (long factors): warm(pin=True) pinned nothing and reported a count."""
    from kvboost_engine import InputError
    engine = Engine(_model("llama"), tokenizer, cache_bytes=1 << 26)
    with pytest.raises(InputError, match="cannot be pinned"):
        engine.warm(TEXT * 4, pin=True)
