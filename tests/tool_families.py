"""Tiny random models of three tool-calling families with their real chat templates (tests/data).

The tokenizer is SmolLM2's plus each family's added tokens (special or not, as in the real
tokenizer), so the templates' control tokens are single tokens as they are for the real models.
"""
from __future__ import annotations

from pathlib import Path

from transformers import AddedToken, AutoTokenizer

from kvboost_engine import Engine
from kvboost_engine.loading import default_model_dir
from tiny_models import tiny_model

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
FAMILIES = {
    # model type: (template, [(added token, special)], bos, eos)
    "qwen2": ("qwen2.5.jinja", [("<tool_call>", False), ("</tool_call>", False)], None, "<|im_end|>"),
    "llama": ("llama3.1.jinja", [("<|begin_of_text|>", True), ("<|start_header_id|>", True),
                                 ("<|end_header_id|>", True), ("<|eot_id|>", True), ("<|eom_id|>", True),
                                 ("<|python_tag|>", True)], "<|begin_of_text|>", "<|eot_id|>"),
    "mistral": ("mistral_v3.jinja", [("<s>", True), ("</s>", True), ("[INST]", True), ("[/INST]", True),
                                     ("[TOOL_CALLS]", True), ("[AVAILABLE_TOOLS]", True),
                                     ("[/AVAILABLE_TOOLS]", True), ("[TOOL_RESULTS]", True),
                                     ("[/TOOL_RESULTS]", True)], "<s>", "</s>"),
}
EXPECTED_FORMAT = {"qwen2": "hermes", "llama": "llama3_json", "mistral": "mistral"}


def family_tokenizer(family: str):
    template, added, bos, eos = FAMILIES[family]
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    tokenizer.add_special_tokens({"additional_special_tokens": [AddedToken(t, special=True, normalized=False)
                                                                for t, special in added if special]})
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t, special in added if not special])
    tokenizer.chat_template = (TEMPLATES / template).read_text()
    tokenizer.eos_token = eos
    if bos is not None:
        tokenizer.bos_token = bos
    return tokenizer


def family_engine(family: str) -> Engine:
    tokenizer = family_tokenizer(family)
    model = tiny_model(family, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                       bos_token_id=tokenizer.bos_token_id)
    return Engine(model, tokenizer, cache_bytes=32 * 2**20, model_name=f"tiny-{family}")
