"""Calibration activations for the quantizer, one decoder layer at a time.

The quantizer walks the decoder layers in order. For layer i it needs the layer's input
hidden states (the output of layer i-1 on the calibration tokens), the keyword arguments
the model passes to its layers (rotary position embeddings, attention mask), and the inputs
of the layer's linears. Only one layer's activations are held at once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvboost_engine.model.arch import LAYER_LINEARS, decoder_layers

from .texts import calibration_texts

# linears whose input the scale and clip searches need, by attribute path in a decoder layer
CAPTURED = LAYER_LINEARS
LAYER_KWARGS = ("position_embeddings", "attention_mask", "position_ids")


@dataclass(slots=True)
class LayerInputs:
    """What a decoder layer is called with on the calibration batch."""

    hidden: torch.Tensor          # [B, S, D]
    kwargs: dict                  # position_embeddings, attention_mask, position_ids (no cache)


def calibration_ids(tokenizer, rows: int, seq_len: int = 256) -> torch.Tensor:
    """[rows, seq_len] token ids: the calibration paragraphs (texts.calibration_texts), in
    order, tokenized one by one and concatenated."""
    needed, ids = rows * seq_len, []
    for text in calibration_texts():
        ids.extend(tokenizer(text)["input_ids"])
        if len(ids) >= needed:
            return torch.tensor(ids[:needed]).reshape(rows, seq_len)
    raise ValueError(f"the calibration text has {len(ids)} tokens, fewer than {rows} rows of {seq_len}")


class _Stop(Exception):
    pass


@torch.inference_mode()
def first_layer_inputs(model: nn.Module, token_ids: torch.Tensor) -> LayerInputs:
    """Run the model up to its first decoder layer on `token_ids` [B, S] and keep that layer's inputs."""
    caught: dict = {}

    def catch(module, args, kwargs):
        caught["hidden"] = args[0] if args else kwargs["hidden_states"]
        caught["kwargs"] = {k: kwargs[k] for k in LAYER_KWARGS if k in kwargs}      # a None mask too
        raise _Stop

    handle = decoder_layers(model)[0].register_forward_pre_hook(catch, with_kwargs=True)
    try:
        model(token_ids, use_cache=False)
    except _Stop:
        pass
    finally:
        handle.remove()
    return LayerInputs(caught["hidden"], caught["kwargs"])


@torch.inference_mode()
def run_layer(layer: nn.Module, inputs: LayerInputs, capture: bool = False
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The layer's output [B, S, D] and, with `capture`, its linears' inputs ([B*S, K] each)."""
    features: dict[str, list[torch.Tensor]] = {}
    handles = []
    for name in CAPTURED if capture else ():
        def keep(module, args, name=name):
            features.setdefault(name, []).append(args[0].reshape(-1, args[0].shape[-1]))
        handles.append(layer.get_submodule(name).register_forward_pre_hook(keep))
    try:
        out = layer(inputs.hidden, **inputs.kwargs)
    finally:
        for handle in handles:
            handle.remove()
    out = out[0] if isinstance(out, tuple) else out
    return out, {k: torch.cat(v) for k, v in features.items()}
