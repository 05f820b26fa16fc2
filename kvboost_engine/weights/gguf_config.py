"""The config of a GGUF model: what transformers' GGUF reader gives, with what it drops put back: the
rotary scaling (gguf_rope.py), Gemma 3's attention scale, and a vocab_size that agrees with the
embedding table.
"""
from __future__ import annotations

import logging
from pathlib import Path

from .gguf_file import GGUFFile
from .gguf_rope import apply_gguf_rope

log = logging.getLogger(__name__)


def gguf_config(gguf_path: Path, file: GGUFFile | None = None):
    """The config transformers reads from a GGUF, with what its reader drops put back: the rotary
    scaling (gguf_rope.py) and Gemma 3's attention scale (gemma3_query_scalar). file: the GGUF
    already opened, if it is."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    file = file or GGUFFile(gguf_path)
    apply_gguf_rope(config, file)
    table = file.tensors.get("token_embd.weight")
    if table is not None and len(table.shape) == 2 and config.vocab_size != table.shape[0]:
        log.warning("%s: vocab_size %s in its metadata, %s rows in its embedding table: the table's count is used",
                    gguf_path.name, config.vocab_size, table.shape[0])
        config.vocab_size = table.shape[0]      # the table is what the model computes with
    if config.model_type == "gemma3_text":
        config.query_pre_attn_scalar = gemma3_query_scalar(config)
    return config


def gemma3_query_scalar(config) -> int:
    """Gemma 3's query_pre_attn_scalar, which a GGUF does not store (transformers' reader leaves its
    default, 256): llama.cpp takes hidden / heads for the 62-layer model (27B: 5376 / 32 = 168, its
    config's value) and head_dim for every other (256 from 270M to 12B)."""
    if config.num_hidden_layers == 62:
        return config.hidden_size // config.num_attention_heads
    return config.head_dim
