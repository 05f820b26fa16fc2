"""A tiny random Qwen3 with the real Qwen3 chat template (tests/data/chat_templates/qwen3.jinja,
Apache-2.0, as in Qwen/Qwen3-0.6B) whose greedy reply is scripted.

The tokenizer is SmolLM2's (same ChatML markers) plus Qwen3's added non-special tokens <think>,
</think>, <tool_call>, </tool_call>. `script` maps a token text to the token that follows it: the
layers' output projections are zeroed, so each position's hidden state is its own token's
embedding, and the head's row for the next token is set to that embedding (scaled; summed over the tokens it follows), so the model
writes e.g. "<think>" after the prompt's last "\\n", then its thinking, then its answer.
"""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AddedToken, AutoTokenizer

from kvboost_engine import Engine
from kvboost_engine.loading import default_model_dir
from tiny_models import tiny_model

TEMPLATE = Path(__file__).parent / "data" / "chat_templates" / "qwen3.jinja"
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
# After the generation prompt ("<|im_start|>assistant\n"): think, then answer. After Qwen3's empty
# think block (enable_thinking=False: the prompt ends "</think>\n\n") straight to the answer.
THINKING = {"\n": "<think>", "<think>": "Let", "Let": "</think>", "</think>": "Paris", "Paris": "<|im_end|>",
            "\n\n": "Rome", "Rome": "<|im_end|>"}


def qwen3_tokenizer():
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    tokenizer.chat_template = TEMPLATE.read_text()
    tokenizer.eos_token = "<|im_end|>"
    return tokenizer


def qwen3_engine(script: dict[str, str] = THINKING, **options) -> Engine:
    tokenizer = qwen3_tokenizer()
    model = tiny_model("qwen3", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    ids = {text: _one_token(tokenizer, text) for pair in script.items() for text in pair}
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        embed = model.model.embed_tokens.weight
        for after in set(script.values()):
            sources = [embed[ids[before]] for before, target in script.items() if target == after]
            model.lm_head.weight[ids[after]] = sum(20 * s / s.pow(2).mean().add(1e-6).sqrt() for s in sources)
    return Engine(model, tokenizer, cache_bytes=32 * 2**20, model_name="tiny-qwen3", **options)


def _one_token(tokenizer, text: str) -> int:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == 1, (text, ids)
    return ids[0]
