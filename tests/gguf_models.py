"""Tiny random GGUF models written with the `gguf` package (no download): a complete file that
transformers and kvboost load (architecture metadata, a byte-level tokenizer, every tensor), in the
tensor types asked for."""
from __future__ import annotations

import math

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, quants

Q = GGMLQuantizationType
HIDDEN, INTER, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 2
HEAD_DIM = {"gemma3": 64, "qwen3": 128}         # head_dim != hidden / heads where the architecture allows
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB = 272                                      # 256 byte tokens, the special ones, padding to 16 rows


def _byte_tokens() -> list[str]:
    """GPT-2's byte-level alphabet: one printable character per byte (its bytes_to_unicode)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _add_tokenizer(w: GGUFWriter) -> None:
    """A byte-level BPE tokenizer with one merge (every other byte one token), ChatML template."""
    tokens = _byte_tokens() + SPECIAL + ["he"]
    tokens += [f"<|pad{i}|>" for i in range(VOCAB - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3] * 3 + [1] + [3] * (VOCAB - 260))
    w.add_token_merges(["h e"])
    w.add_bos_token_id(256)
    w.add_eos_token_id(258)
    w.add_pad_token_id(256)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _kquant_bytes(rng, qtype: Q, rows: int, cols: int) -> np.ndarray:
    """Random K-quant blocks with finite fp16 scales (the gguf package cannot quantize to K-quants)."""
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, block_bytes), dtype=np.uint8)
    for start in {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}[qtype]:
        scale = (np.abs(rng.standard_normal(raw.shape[:2])) * 0.0005 + 0.0001).astype(np.float16)
        raw[..., start:start + 2] = scale[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def write_metadata(path, arch: str, fill=None) -> None:
    """A GGUF of `arch` with no tensors: only what fill(writer) adds (nothing: the bare header)."""
    w = GGUFWriter(str(path), arch)
    if fill is not None:
        fill(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()


def llama3_divisors(theta: float, dim: int, factor: float, low: float, high: float, context: int) -> np.ndarray:
    """The rope_freqs llama.cpp's converter writes for a "llama3" rotary (its loop, in float32): the
    tests' own copy of it, so the solver in weights/gguf_rope.py is checked against the converter, not
    against its own llama3_divisors."""
    freqs = 1.0 / (np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / float(freq)
        if wavelen < context / high:
            out.append(1.0)
        elif wavelen > context / low:
            out.append(factor)
        else:
            smooth = (context / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def add_rope_scaling(w: GGUFWriter, rope: dict, head_dim: int, theta: float) -> None:
    """rope: {"type": "llama3", factor, low, high, context} (a rope_freqs tensor, as the converter writes
    it), or {"type": linear / yarn / anything, "factor", and optional GGUF scaling keys}."""
    if rope["type"] == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_divisors(theta, head_dim, *(rope[k] for k in (
            "factor", "low", "high", "context"))))
        return
    w.add_string(f"{w.arch}.rope.scaling.type", rope["type"])
    w.add_rope_scaling_factor(rope["factor"])
    for key, add in (("original_context", w.add_rope_scaling_orig_ctx_len), ("beta_fast", w.add_rope_scaling_yarn_beta_fast),
                     ("beta_slow", w.add_rope_scaling_yarn_beta_slow), ("attn_factor", w.add_rope_scaling_yarn_attn_factor),
                     ("ext_factor", w.add_rope_scaling_yarn_ext_factor)):
        if key in rope:
            add(rope[key])


def write_model(path, arch: str, qtype: Q, *, head: Q | None = None, embed: Q | None = None, tied: bool = True,
                bias: bool = False, seed: int = 0, rope: dict | None = None, theta: float = 10000.0,
                context: int = 2048) -> None:
    """A tiny `arch` model: matrices in `qtype` (the head in `head`, the embedding in `embed`); rope: its
    rotary scaling as llama.cpp's converter writes it (add_rope_scaling), theta its base, context its
    context length."""
    rng = np.random.default_rng(seed)
    head_dim = HEAD_DIM.get(arch, HIDDEN // HEADS)
    vocab = VOCAB
    w = GGUFWriter(str(path), arch)
    w.add_name(f"{arch} tiny")
    w.add_context_length(context)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(vocab)
    if arch == "gemma3":
        w.add_sliding_window(64)
    _add_tokenizer(w)
    kv, q = KV_HEADS * head_dim, HEADS * head_dim
    shapes = {"token_embd.weight": (vocab, HIDDEN), "output_norm.weight": (HIDDEN,)}
    if not tied:
        shapes["output.weight"] = (vocab, HIDDEN)
    parts = {"attn_norm": (HIDDEN,), "attn_q": (q, HIDDEN), "attn_k": (kv, HIDDEN), "attn_v": (kv, HIDDEN),
             "attn_output": (HIDDEN, q), "ffn_norm": (HIDDEN,), "ffn_gate": (INTER, HIDDEN),
             "ffn_up": (INTER, HIDDEN), "ffn_down": (HIDDEN, INTER)}
    if arch in ("qwen3", "gemma3"):
        parts.update(attn_q_norm=(head_dim,), attn_k_norm=(head_dim,))
    if arch == "gemma3":
        parts.update(post_attention_norm=(HIDDEN,), post_ffw_norm=(HIDDEN,))
    for i in range(LAYERS):
        shapes.update({f"blk.{i}.{p}.weight": s for p, s in parts.items()})
        if bias:
            shapes.update({f"blk.{i}.attn_{p}.bias": (n,) for p, n in (("q", q), ("k", kv), ("v", kv))})
    for name, shape in shapes.items():
        kind = embed if name == "token_embd.weight" else head if name == "output.weight" else qtype
        if len(shape) == 1:
            values = rng.standard_normal(shape).astype(np.float32) * (0.02 if name.endswith("bias") else 0.1)
            w.add_tensor(name, values + (0 if name.endswith("bias") else 1.0))
        elif (kind or qtype) in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
            w.add_tensor(name, _kquant_bytes(rng, kind or qtype, *shape), raw_dtype=kind or qtype)
        else:
            values = rng.standard_normal(shape).astype(np.float32) * 0.05
            kind = kind or qtype
            w.add_tensor(name, values if kind == Q.F32 else quants.quantize(values, kind), raw_dtype=kind)
    if rope is not None:
        add_rope_scaling(w, rope, head_dim, theta)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def native_tracks_torch(model, prompt: list[int], steps: int, capacity: int, tolerance: float = 0.04) -> None:
    """The native step's decode logits of `model` (a packed GGUF model) track its PyTorch loop over the
    same codes, `steps` tokens after `prompt`, within `tolerance` (relative norm: int8 activations ~1.5 %)."""
    import torch

    from kvboost_engine.kv.contiguous import SequenceKV
    from kvboost_engine.model.arch import ModelAdapter
    from kvboost_engine.model.forward import Forward
    from kvboost_engine.native.decoder import native_decoder
    adapter = ModelAdapter(model)
    decoder, reason = native_decoder(adapter, threads=2)
    assert decoder is not None, reason
    kv_torch, kv_native = (SequenceKV(adapter.geometry, capacity, adapter.device) for _ in range(2))
    with torch.inference_mode():
        Forward(adapter)(kv_torch, prompt, 0)
        Forward(adapter)(kv_native, prompt, 0)
        for n, token in enumerate(prompt[:steps]):
            want, got = Forward(adapter)(kv_torch, [token], len(prompt) + n), decoder(kv_native, token, len(prompt) + n)
            assert ((got - want).norm() / want.norm()).item() < tolerance
