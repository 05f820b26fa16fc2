"""The one place that knows transformers internals: supported architectures and module layout.

Everything downstream talks to a `ModelAdapter`, never to HF module names directly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import UnsupportedModelError
from ..kv.geometry import KVGeometry


@dataclass(slots=True, frozen=True)
class ArchSpec:
    """What we rely on for one HF `model_type` (all follow the Llama module layout)."""

    family: str
    notes: str


# model_type -> spec. Every entry is exercised by tests with a tiny random model.
SUPPORTED_ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": ArchSpec("llama", "Llama 2/3, SmolLM2, TinyLlama; rope default/linear/dynamic/llama3/yarn"),
    "mistral": ArchSpec("llama", "Mistral; optional sliding window"),
    "qwen2": ArchSpec("llama", "Qwen2/Qwen2.5; qkv bias; per-layer sliding window"),
    "qwen3": ArchSpec("llama", "Qwen3; q/k RMSNorm per head"),
    "phi3": ArchSpec("llama", "Phi-3/3.5; fused qkv, partial rotary, longrope"),
}


# The decoder-layer linears of the Llama layout, by path inside a layer: the AWQ loader and the
# offline quantizer (kvboost_tools.awq) address modules by these names.
LAYER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


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
    return spec


class ModelAdapter:
    """Uniform access to the pieces of a supported HF causal LM.

    The engine runs its own loop: `embed` -> `rotary` -> each of `layers` -> `norm` ->
    `lm_head`, passing a `kvboost_step` keyword that our registered attention function uses
    to read and write KV. HF modules keep doing projections, norms, rotary and MLPs.
    """

    def __init__(self, model: torch.nn.Module):
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
        self.geometry = KVGeometry(len(self.layers), kv_heads, head_dim, self.dtype)
        self.context_window = int(config.max_position_embeddings)
        self.layer_windows = tuple(self._window(i) for i in range(len(self.layers)))

    def _window(self, layer_idx: int) -> int | None:
        """Sliding-window size of one layer (None = full attention), as HF's modules define it."""
        window = getattr(self.config, "sliding_window", None)
        layer_types = getattr(self.config, "layer_types", None)
        if layer_types:
            return window if layer_types[layer_idx] == "sliding_attention" else None
        if self.config.model_type in ("mistral", "phi3"):
            return window
        return None

    def rope_settings(self) -> dict:
        """Rope configuration as a plain dict (part of the model fingerprint)."""
        params = getattr(self.config, "rope_parameters", None) or {}
        return {k: params[k] for k in sorted(params)}

    def position_embeddings(self, hidden: torch.Tensor, positions: torch.Tensor):
        """cos/sin for `positions` [1, N], computed by the model's own rotary module."""
        return self.rotary(hidden, position_ids=positions)

    def run_layer(self, layer_idx: int, hidden, position_embeddings, positions, step):
        out = self.layers[layer_idx](
            hidden,
            attention_mask=None,
            position_embeddings=position_embeddings,
            position_ids=positions,
            kvboost_step=step,
        )
        return out[0] if isinstance(out, tuple) else out

    def logits_last(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and lm_head on the last position only: [1, N, hidden] -> [vocab] fp32."""
        return self.lm_head(self.norm(hidden[:, -1:, :]))[0, -1].float()

    def logits_at(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """Final norm and lm_head on the given positions only: [1, N, hidden] -> [len(rows), vocab] fp32."""
        return self.lm_head(self.norm(hidden[:, rows, :]))[0].float()
