"""The one place that knows transformers internals: supported architectures and module layout.

Everything downstream talks to a `ModelAdapter`, never to HF module names directly.
"""
from __future__ import annotations

import functools

from dataclasses import dataclass

import torch

from ..errors import InputError, UnsupportedModelError
from . import compat
from ..kv.geometry import KVGeometry


@dataclass(slots=True, frozen=True)
class ArchSpec:
    """What we rely on for one HF `model_type` (all follow the Llama module layout).

    rope_per_layer_type: the rotary module holds one set of frequencies per entry of
    `config.layer_types` and takes the layer type as an argument (Gemma 3: local and global bases).
    """

    family: str
    notes: str
    rope_per_layer_type: bool = False


# model_type -> spec. Every entry is exercised by tests with a tiny random model.
SUPPORTED_ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": ArchSpec("llama", "Llama 2/3, SmolLM2, TinyLlama; rope default/linear/dynamic/llama3/yarn"),
    "mistral": ArchSpec("llama", "Mistral; optional sliding window"),
    "qwen2": ArchSpec("llama", "Qwen2/Qwen2.5; qkv bias; per-layer sliding window"),
    "qwen3": ArchSpec("llama", "Qwen3; q/k RMSNorm per head"),
    "phi3": ArchSpec("llama", "Phi-3/3.5; fused qkv, partial rotary, longrope"),
    "gemma3_text": ArchSpec("gemma3", "Gemma 3 text: sliding-window and global layers with their own RoPE bases, "
                            "q/k norms, scaled embeddings, final logit softcap", rope_per_layer_type=True),
}
if not compat.V5:       # transformers 4.x keeps Gemma 3's two rotaries in other modules: 5.x only
    del SUPPORTED_ARCHITECTURES["gemma3_text"]


# The decoder-layer linears of the Llama layout, by path inside a layer: the AWQ loader and the
# offline quantizer (kvboost_tools.awq) address modules by these names.
LAYER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")

# Model types whose decoder layer is plain Llama math: RMSNorm (weight * x / rms), rotary over the
# whole head, a gate/up/down MLP (SiLU); Qwen3 adds an RMSNorm over each query and key head before the
# rotary (LayerParts.q_norm / k_norm); Gemma 3 those too, an RMSNorm over the attention's and the
# MLP's outputs before each residual add (attn_norm / mlp_norm), norms of (1 + weight) (LayerParts
# holds 1 + weight), GELU (tanh), scaled embeddings (its own embedding module), and two rotary bases
# (ModelAdapter.layer_rope_kinds). Code that runs the layer math itself (the native decode step)
# takes only these, through `ModelAdapter.layer_parts`.
PLAIN_LLAMA_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
PLAIN_ACTS = ("silu", "gelu_pytorch_tanh")      # the MLP activations of those
STATIC_ROPE = ("default", "linear", "llama3", "yarn")    # rope types whose inv_freq does not depend on the length


@dataclass(slots=True, frozen=True)
class LayerParts:
    """One decoder layer of a plain-Llama model as plain parts."""

    input_norm: torch.Tensor        # RMSNorm weights (what x / rms is multiplied by)
    post_norm: torch.Tensor         # before the MLP
    linears: tuple                  # the modules at LAYER_LINEARS, in that order
    scaling: float                  # attention score scale
    head_dim: int
    q_norm: torch.Tensor | None = None   # RMSNorm weights [head_dim] over each query / key head before
    k_norm: torch.Tensor | None = None   # the rotary (Qwen3, Gemma 3), or None
    attn_norm: torch.Tensor | None = None   # RMSNorm weights over the attention's / the MLP's output
    mlp_norm: torch.Tensor | None = None    # before its residual add (Gemma 3), or None


@dataclass(slots=True, frozen=True)
class PlainLlama:
    """The sizes of a plain-Llama model (see PLAIN_LLAMA_TYPES)."""

    hidden: int
    heads: int
    intermediate: int
    rms_norm_eps: float
    final_norm: torch.Tensor
    act: str = "silu"                # the MLP's activation (PLAIN_ACTS)


# MKL's fp32 GEMM against a large fp32 lm_head takes a slow path for 8-15 rows: 8 rows cost about
# 1.3x 16 rows (cold weights, 49152 x 576). A batched decode step's logits are padded to 16 rows
# there (zero rows, dropped after); each row's logits do not depend on the others.
LM_HEAD_SLOW_ROWS = (8, 16)


def decoder_layers(model: torch.nn.Module) -> list:
    """The decoder layers of a supported causal LM, in order."""
    return list(model.model.layers)


def rebuild_rotary(model: torch.nn.Module) -> None:
    """Recreate the rotary module from the config (its buffers are unset after `to_empty`)."""
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(config=model.config)


def tie_output_embeddings(model: torch.nn.Module) -> None:
    """Share the input embedding matrix with the output head (tie_word_embeddings)."""
    model.lm_head.weight = model.model.embed_tokens.weight


def check_supported(config) -> ArchSpec:
    """Return the spec for `config.model_type` or raise a clear error listing what is supported."""
    model_type = getattr(config, "model_type", None)
    spec = SUPPORTED_ARCHITECTURES.get(model_type)
    if spec is None:
        supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
        raise UnsupportedModelError(
            f"architecture {model_type!r} is not supported by kvboost (supported: {supported})"
        )
    _check_options(config, model_type)
    return spec


def _check_options(config, model_type: str) -> None:
    """Refuse settings of a supported architecture that our layer loop does not reproduce."""
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModelError(
            f"{model_type} with use_bidirectional_attention=True (an embedding model) is not supported: "
            "kvboost runs causal language models")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    params = compat.rope_parameters(config)
    for settings in (params.values() if params and all(isinstance(v, dict) for v in params.values()) else [params]):
        kind = settings.get("rope_type", settings.get("type", "default"))
        if kind != "default" and kind not in ROPE_INIT_FUNCTIONS:       # transformers' build: a bare KeyError
            raise UnsupportedModelError(f"{model_type} with rope_type {kind!r} is not supported (transformers knows: "
                                        f"default, {', '.join(sorted(ROPE_INIT_FUNCTIONS))})")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        # transformers' Gemma 3 attention stores the value but never applies it (nor would our
        # attention function); refusing is better than silently differing from the reference.
        raise UnsupportedModelError(
            f"{model_type} with attn_logit_softcapping={config.attn_logit_softcapping} is not supported: "
            "kvboost's attention does not apply attention logit soft-capping")


class ModelAdapter:
    """Uniform access to the pieces of a supported HF causal LM.

    The engine runs its own loop: `embed` -> `rotary` -> each of `layers` -> `norm` ->
    `lm_head`, passing a `kvboost_step` keyword that our registered attention function uses
    to read and write KV. HF modules keep doing projections, norms, rotary and MLPs.
    """

    def __init__(self, model: torch.nn.Module, kv_dtype: torch.dtype | None = None):
        """kv_dtype: the element type of the model's KV (geometry.dtype); None: the model's dtype."""
        config = model.config
        self.spec = check_supported(config)
        self.model = model
        self.config = config
        decoder = model.model
        self.embed = decoder.embed_tokens
        self.layers = list(decoder.layers)
        self.norm = decoder.norm
        self.rotary = decoder.rotary_emb
        self.lm_head = model.lm_head
        param = next(model.parameters())
        self.device = param.device
        self.dtype = param.dtype
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        self.geometry = KVGeometry(len(self.layers), kv_heads, head_dim, kv_dtype or self.dtype)
        if (reason := self.geometry.unsupported()) is not None:
            raise InputError(reason)
        self.context_window = int(config.max_position_embeddings)
        self.layer_windows = tuple(self._window(i) for i in range(len(self.layers)))
        # which of the rotary's frequency sets each layer uses (None: the rotary has one set)
        self.layer_rope_kinds = (tuple(config.layer_types) if self.spec.rope_per_layer_type
                                 else (None,) * len(self.layers))
        self.final_softcap = getattr(config, "final_logit_softcapping", None)
        head = self.lm_head
        self._pad_head_rows = (type(head) is torch.nn.Linear and head.weight.dtype == torch.float32
                               and head.weight.device.type == "cpu")

    def _window(self, layer_idx: int) -> int | None:
        """Sliding-window size of one layer (None = full attention), as HF's modules define it."""
        window = getattr(self.config, "sliding_window", None)
        if self.config.model_type in ("mistral", "phi3"):
            return window               # every layer, whatever layer_types says (HF's Mistral / Phi-3 masks)
        layer_types = getattr(self.config, "layer_types", None)
        if layer_types:
            return window if layer_types[layer_idx] == "sliding_attention" else None
        return None

    def rope_settings(self) -> dict:
        """Rope configuration as a plain dict (part of the model fingerprint)."""
        params = compat.rope_parameters(self.config)
        return {k: params[k] for k in sorted(params)}

    def rope_kinds(self) -> dict:
        """Per rope kind (None, or a layer type): (inv_freq [rotary_dim / 2], rope settings of that kind),
        the frequencies the model's own rotary module rotates with."""
        params = self.rope_settings()
        out = {}
        for kind in sorted(set(self.layer_rope_kinds), key=str):
            if kind is None:
                inv_freq = getattr(self.rotary, "original_inv_freq", None)
                out[kind] = (self.rotary.inv_freq if inv_freq is None else inv_freq, params)
            else:
                out[kind] = (getattr(self.rotary, f"{kind}_original_inv_freq"), params.get(kind) or {})
        return out

    @property
    def static_rope(self) -> bool:
        """Whether every rotary kind's frequencies are the same whatever the sequence length (default,
        linear, llama3, yarn): a position's cos / sin then do not depend on the other positions of a
        call. longrope chooses its frequencies by the call's largest position, dynamic by it and the
        largest seen before (HF's dynamic_rope_update keeps it)."""
        params = self.rope_settings()
        kinds = [params if kind is None else (params.get(kind) or {}) for kind in set(self.layer_rope_kinds)]
        return all(str(p.get("rope_type", "default")) in STATIC_ROPE for p in kinds)

    @functools.cached_property
    def regime_limit(self) -> int | None:
        """For longrope (Phi-3 128k): the original window. HF chooses its short or long factors by a
        call's length, so a prompt longer than this is computed with the long ones from its first
        position (KV no shorter call can share); None for every other rope type."""
        params = self.rope_settings()
        kinds = [params if kind is None else (params.get(kind) or {}) for kind in set(self.layer_rope_kinds)]
        if not any(str(p.get("rope_type")) == "longrope" for p in kinds):
            return None
        limits = [p.get("original_max_position_embeddings") for p in kinds if p.get("original_max_position_embeddings")]
        return int(min(limits) if limits else getattr(self.config, "original_max_position_embeddings", 0)
                   or self.context_window)

    def position_embeddings(self, hidden: torch.Tensor, positions: torch.Tensor, regime_end: int | None = None) -> dict:
        """cos/sin for `positions` [1, N] per rope kind, computed by the model's own rotary module
        (one call per kind, not per layer). `regime_end`: the length of the whole call these
        positions are part of (a prompt computed in chunks), for a rotary whose frequencies the
        call's length chooses (longrope): as the one call would."""
        if regime_end is not None and regime_end > int(positions.max()) + 1 and self.regime_limit is not None:
            ext = torch.cat([positions, positions.new_full((1, 1), regime_end - 1)], dim=1)
            full = self.position_embeddings(hidden[:, :1].expand(-1, ext.shape[1], -1), ext)
            return {kind: tuple(t[:, :-1] for t in pair) for kind, pair in full.items()}
        kinds = set(self.layer_rope_kinds)
        if kinds == {None}:
            return {None: self.rotary(hidden, position_ids=positions)}
        return {kind: self.rotary(hidden, positions, kind) for kind in kinds}

    def run_layer(self, layer_idx: int, hidden, position_embeddings: dict, positions, step):
        out = self.layers[layer_idx](
            hidden,
            attention_mask=None,
            position_embeddings=position_embeddings[self.layer_rope_kinds[layer_idx]],
            position_ids=positions,
            kvboost_step=step,
        )
        return out[0] if isinstance(out, tuple) else out

    def plain_llama(self) -> tuple[PlainLlama | None, str | None]:
        """(the model's sizes, None) when its layers are plain Llama math, else (None, why not)."""
        config = self.config
        if config.model_type not in PLAIN_LLAMA_TYPES:
            return None, f"model type {config.model_type!r} (plain Llama layers: {', '.join(PLAIN_LLAMA_TYPES)})"
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
        if act not in PLAIN_ACTS or getattr(config, "mlp_bias", False):
            return None, f"needs a {' or '.join(PLAIN_ACTS)} MLP without bias (has {act})"
        if any(getattr(layer.self_attn, "head_dim", self.geometry.head_dim) != self.geometry.head_dim
               for layer in self.layers):
            return None, "attention head size differs from the KV geometry"
        return PlainLlama(config.hidden_size, config.num_attention_heads, config.intermediate_size,
                          float(config.rms_norm_eps), self._norm_weight(self.norm), act), None

    def _norm_weight(self, norm) -> torch.Tensor:
        """What an RMSNorm module multiplies x / rms by: its weight, or Gemma's 1 + weight (float32,
        as Gemma3RMSNorm computes it)."""
        return 1.0 + norm.weight.float() if self.spec.family == "gemma3" else norm.weight

    def layer_parts(self, layer_idx: int) -> LayerParts:
        """Layer `layer_idx` of a plain-Llama model (check `plain_llama` first) as plain parts."""
        layer = self.layers[layer_idx]
        head_dim = self.geometry.head_dim
        q_norm, k_norm = (getattr(layer.self_attn, name, None) for name in ("q_norm", "k_norm"))
        weight = lambda norm: None if norm is None else self._norm_weight(norm)
        if self.spec.family == "gemma3":        # post_attention_layernorm is over the attention's output
            before_mlp, attn_norm, mlp_norm = (layer.pre_feedforward_layernorm, layer.post_attention_layernorm,
                                               layer.post_feedforward_layernorm)
        else:
            before_mlp, attn_norm, mlp_norm = layer.post_attention_layernorm, None, None
        return LayerParts(weight(layer.input_layernorm), weight(before_mlp),
                          tuple(layer.get_submodule(name) for name in LAYER_LINEARS),
                          float(getattr(layer.self_attn, "scaling", head_dim ** -0.5)), head_dim,
                          weight(q_norm), weight(k_norm), weight(attn_norm), weight(mlp_norm))

    def logits_last(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm, lm_head (and final logit soft-capping where the model has it) on the last
        position only: [1, N, hidden] -> [vocab] fp32."""
        return self.logits_at(hidden, [hidden.shape[1] - 1])[0]

    def logits_at(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """Final norm, lm_head (and final logit soft-capping where the model has it) on the given
        positions only: [1, N, hidden] -> [len(rows), vocab] fp32."""
        normed = self.norm(hidden[:, rows, :])
        n = len(rows)
        if self._pad_head_rows and LM_HEAD_SLOW_ROWS[0] <= n < LM_HEAD_SLOW_ROWS[1]:
            normed = torch.cat([normed, normed.new_zeros(1, LM_HEAD_SLOW_ROWS[1] - n, normed.shape[-1])], dim=1)
        logits = self.lm_head(normed)[0, :n]
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits.float()
