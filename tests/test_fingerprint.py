"""The model fingerprint identifies the weights by all their bytes (and dtype, config, rope,
tokenizer): a model edited in the middle of one tensor never shares KV with the original."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoTokenizer

from kvboost_engine import Engine
from kvboost_engine.loading import default_model_dir
from kvboost_engine.model.fingerprint import model_fingerprint, tokenizer_digest, weights_digest
from kvboost_engine.weights import checkpoint as checkpoint_module
from kvboost_engine.weights.checkpoint import Checkpoint
from tiny_models import tiny_model

MESSAGES = [{"role": "system", "content": "You answer in one word. " * 10},
            {"role": "user", "content": "What colour is the sky?"}]
ROPE = {"rope_type": "default"}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_model_dir())


@pytest.fixture(scope="module")
def original():
    return tiny_model("llama", max_position_embeddings=512)


def edited_copy(model, layer: int = 0):
    """A copy whose mlp.down_proj weight differs in one element in the middle (far from either end)."""
    twin = copy.deepcopy(model)
    weight = twin.model.layers[layer].mlp.down_proj.weight
    with torch.no_grad():
        weight.view(-1)[weight.numel() // 2] += 0.5
    return twin


def test_an_edit_in_the_middle_of_one_tensor_changes_the_fingerprint(original, tokenizer):
    same = model_fingerprint(copy.deepcopy(original), ROPE, tokenizer)
    assert model_fingerprint(original, ROPE, tokenizer) == same
    assert model_fingerprint(edited_copy(original), ROPE, tokenizer) != same
    assert model_fingerprint(edited_copy(original, layer=1), ROPE, tokenizer) != same
    assert model_fingerprint(copy.deepcopy(original).to(torch.bfloat16), ROPE, tokenizer) != same
    assert model_fingerprint(original, {"rope_type": "linear", "factor": 2.0}, tokenizer) != same


def test_tied_weights_are_hashed_once_but_named(tokenizer):
    tied = tiny_model("llama", max_position_embeddings=512, tie_word_embeddings=True)
    state = tied.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    assert weights_digest(tied, threads=1) == weights_digest(tied, threads=4)


def test_the_tokenizer_is_part_of_the_fingerprint(original, tokenizer):
    other_template = copy.deepcopy(tokenizer)
    other_template.chat_template = tokenizer.chat_template.replace("helpful", "useful")
    assert tokenizer_digest(other_template) != tokenizer_digest(tokenizer)
    other_vocab = copy.deepcopy(tokenizer)
    other_vocab.add_tokens(["<kvboost-new-token>"])
    assert tokenizer_digest(other_vocab) != tokenizer_digest(tokenizer)
    assert model_fingerprint(original, ROPE, other_template) != model_fingerprint(original, ROPE, tokenizer)


def test_a_checkpoint_digest_stands_for_the_weights_of_a_model_not_all_in_memory(original, tokenizer):
    twin = copy.deepcopy(original)
    twin.config.quantization_config = {"quant_method": "awq", "weights_digest": "a" * 32}
    first = model_fingerprint(twin, ROPE, tokenizer)
    with torch.no_grad():
        twin.model.layers[0].mlp.down_proj.weight.zero_()      # not read: the checkpoint's hash stands
    assert model_fingerprint(twin, ROPE, tokenizer) == first
    twin.config.quantization_config = {"quant_method": "awq", "weights_digest": "b" * 32}
    assert model_fingerprint(twin, ROPE, tokenizer) != first


def test_an_edited_model_sharing_a_disk_cache_never_restores_the_originals_kv(original, tokenizer, tmp_path):
    edited = edited_copy(original)
    with Engine(original, tokenizer, disk_cache_dir=str(tmp_path)) as first:
        first.chat(MESSAGES, max_new_tokens=6)                 # its entries are on disk once closed
    written = list(tmp_path.rglob("*.kv"))
    assert written
    cold = Engine(edited, tokenizer, cache_bytes=0)
    assert not torch.equal(cold.next_token_logits(messages=MESSAGES),
                           Engine(original, tokenizer, cache_bytes=0).next_token_logits(messages=MESSAGES))
    second = Engine(edited, tokenizer, disk_cache_dir=str(tmp_path))
    assert second.fingerprint != first.fingerprint and second.stats()["disk_entries"] == 0
    gen = second.chat(MESSAGES, max_new_tokens=6)
    assert second.stats()["disk_hits"] == 0 and gen.reused_tokens == 0
    assert gen.token_ids == cold.chat(MESSAGES, max_new_tokens=6).token_ids
    again = Engine(original, tokenizer, disk_cache_dir=str(tmp_path))    # the original's entries are intact
    assert again.chat(MESSAGES, max_new_tokens=6).token_ids == Engine(original, tokenizer, cache_bytes=0).chat(
        MESSAGES, max_new_tokens=6).token_ids
    assert again.stats()["disk_hits"] > 0


def _write_checkpoint(directory, model) -> None:
    from safetensors.torch import save_file
    directory.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"},
              str(directory / "model.safetensors"))


def test_checkpoint_digest_reads_every_byte_and_is_computed_once(original, tmp_path, monkeypatch):
    _write_checkpoint(tmp_path / "a", original)
    _write_checkpoint(tmp_path / "b", edited_copy(original))
    cache = tmp_path / "packs"
    digest = Checkpoint(tmp_path / "a").digest(cache)
    assert Checkpoint(tmp_path / "b").digest(cache) != digest           # the middle of one tensor differs
    assert Checkpoint(tmp_path / "a").digest() == digest
    calls = []
    real = checkpoint_module.hash_file
    monkeypatch.setattr(checkpoint_module, "hash_file", lambda *a: calls.append(a) or real(*a))
    assert Checkpoint(tmp_path / "a").digest(cache) == digest and not calls     # cached: nothing read
    path = tmp_path / "a" / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))                                       # a new file identity (mtime)
    assert Checkpoint(tmp_path / "a").digest(cache) != digest and calls
