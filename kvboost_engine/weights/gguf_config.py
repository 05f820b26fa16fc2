"""The config of a GGUF model: what transformers' GGUF reader gives, with what it drops put back: the
rotary scaling (gguf_rope.py), Gemma 3's attention scale, and a vocab_size that agrees with the
embedding table.
"""
from __future__ import annotations

import logging
from pathlib import Path

from ..errors import InputError, UnsupportedModelError
from .gguf_file import GGUFFile
from .gguf_rope import apply_gguf_rope

log = logging.getLogger(__name__)


def gguf_config(gguf_path: Path, file: GGUFFile | None = None):
    """The config transformers reads from a GGUF, with what its reader drops put back: the rotary
    scaling (gguf_rope.py), Qwen3's head_dim and Gemma 3's attention scale (gemma3_query_scalar). file: the GGUF
    already opened, if it is."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    file = file or GGUFFile(gguf_path)
    check_tensors_read(file, config)
    apply_gguf_rope(config, file)
    key_length = file.field(f"{file.architecture}.attention.key_length")
    if config.model_type == "qwen3" and isinstance(key_length, int):    # transformers' reader keeps 128
        config.head_dim = key_length
    table = file.tensors.get("token_embd.weight")
    if table is not None and len(table.shape) == 2 and config.vocab_size != table.shape[0]:
        log.warning("%s: vocab_size %s in its metadata, %s rows in its embedding table: the table's count is used",
                    gguf_path.name, config.vocab_size, table.shape[0])
        config.vocab_size = table.shape[0]      # the table is what the model computes with
    if config.model_type == "gemma3_text":
        config.query_pre_attn_scalar = gemma3_query_scalar(config)
    return config


def gguf_tokenizer(gguf_path: Path):
    """transformers' tokenizer of a GGUF; a token id the file names past its vocabulary (its
    eos / bos / pad) is an InputError naming the file, not a bare IndexError from the reader."""
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except (IndexError, KeyError) as err:
        raise InputError(f"{gguf_path}: its tokenizer cannot be read ({type(err).__name__}: {err}): a token id "
                         "in its metadata (tokenizer.ggml.eos_token_id, ...) past its vocabulary?") from err
    except Exception as err:            # the tokenizers library's own (a bare Exception: "Token '\n' out of vocabulary")
        raise InputError(f"{gguf_path}: transformers cannot build its tokenizer ({type(err).__name__}: {err}); "
                         f"its tokenizer.ggml.model is {GGUFFile(gguf_path).field('tokenizer.ggml.model')!r}") from err


BIASES_READ = {"qwen2": ("attn_q.bias", "attn_k.bias", "attn_v.bias")}   # the block biases each model has


def check_tensors_read(file: GGUFFile, config) -> None:
    """Refuse a file whose tensors the model built from its config would not read, or read as random
    initial values (both paths, packed and float32): a mixture of experts (Mixtral's experts and
    router), block biases the architecture has none of (llama.cpp adds them where present), Qwen2's
    q / k / v biases missing, a Phi-3 rotating part of each head (rope.dimension_count, which
    transformers' reader drops)."""
    arch, names = file.architecture, file.tensors
    experts = file.field(f"{arch}.expert_count")
    moe = next((n for n in names if "_exps." in n or ".ffn_gate_inp." in n), None)
    if (isinstance(experts, int) and experts > 0) or moe is not None:
        raise UnsupportedModelError(f"{file.path.name}: a mixture of experts ({moe or f'{experts} experts'}) is not "
                                    "supported")
    read = BIASES_READ.get(config.model_type, ())
    extra = next((n for n in names if n.startswith("blk.") and n.endswith(".bias") and n.split(".", 2)[2] not in read),
                 None)
    if extra is not None:
        raise UnsupportedModelError(f"{file.path.name}: tensor {extra} is a bias a {config.model_type} model does not "
                                    "have (it would be dropped)")
    for i in range(config.num_hidden_layers):
        missing = next((f"blk.{i}.{b}" for b in read if f"blk.{i}.{b}" not in names), None)
        if missing is not None:
            raise UnsupportedModelError(f"{file.path.name} lacks {missing}, which a {config.model_type} model has")
    rot = file.field(f"{arch}.rope.dimension_count")
    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if config.model_type == "phi3" and isinstance(rot, int) and rot != head:
        raise UnsupportedModelError(f"{file.path.name}: rotary over {rot} of each head's {head} dimensions "
                                    "(partial rotary from a GGUF) is not supported")


def gemma3_query_scalar(config) -> int:
    """Gemma 3's query_pre_attn_scalar, which a GGUF does not store (transformers' reader leaves its
    default, 256): llama.cpp takes hidden / heads for the 62-layer model (27B: 5376 / 32 = 168, its
    config's value) and head_dim for every other (256 from 270M to 12B)."""
    if config.num_hidden_layers == 62:
        return config.hidden_size // config.num_attention_heads
    return config.head_dim
