"""Our AWQ quantizer: writes AutoAWQ's GEMM checkpoint format (format.py).

Layer by layer on calibration text (calibrate.py): capture the inputs of the layer's linears,
search activation-aware input scales per group of linears sharing an input and fold them into
the preceding op (search.py), search per-group range clipping for all but q/k, then round to
nearest 4-bit per group. The next layer's inputs are this layer's float outputs (the scaling
leaves the float model unchanged). With no calibration tokens: plain round-to-nearest.

    python -m kvboost_tools.awq.quantize --out DIR [--model DIR] [--group-size 32]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from kvboost_engine.model.arch import decoder_layers
from kvboost_engine.weights.awq.format import AWQConfig

from .calibrate import LayerInputs, calibration_ids, first_layer_inputs, run_layer
from .grid import pack_groups, quantize_groups, round_groups
from .rounding import feedback_round, second_moment
from .search import apply_scale, scale_groups, search_clip, search_scale

__all__ = ["SearchOptions", "calibration_ids", "quantize_model", "save_checkpoint", "main"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                   "special_tokens_map.json", "vocab.json", "merges.txt")
# which captured input each linear reads (k/v read q's input, up reads gate's)
FEATURE_OF = {"self_attn.q_proj": "self_attn.q_proj", "self_attn.k_proj": "self_attn.q_proj",
              "self_attn.v_proj": "self_attn.q_proj", "self_attn.o_proj": "self_attn.o_proj",
              "mlp.gate_proj": "mlp.gate_proj", "mlp.up_proj": "mlp.gate_proj", "mlp.down_proj": "mlp.down_proj"}
ROUNDINGS = ("nearest", "feedback")
NO_CLIP = ("self_attn.q_proj", "self_attn.k_proj")     # errors there pass through q.k products


@dataclass(slots=True, frozen=True)
class SearchOptions:
    """Scale search grid and mode, clipping, rounding ("nearest" or "feedback", see rounding.py),
    whether the next layer sees this layer's quantized output, and the rows block losses use."""

    grid: int = 20
    duo: bool = True
    clip: bool = True
    rounding: str = "nearest"
    sequential: bool = False
    loss_rows: int = 8


DEFAULTS = SearchOptions()


QUANTIZABLE = ("llama", "mistral", "qwen2", "qwen3")    # RMSNorm weights that multiply, the MLP's input norm
                                                        # post_attention_layernorm, one kind of layer


def check_quantizable(model: nn.Module, group_size: int | None = None) -> None:
    """ValueError where the scale folding and the calibration chain cannot keep the float model: an
    architecture other than QUANTIZABLE (Gemma's norms scale by 1 + w, its MLP norm is another
    module, its layers differ in attention), layers of several attention kinds (each layer is
    calibrated with the first one's mask), a linear whose inputs are no whole number of groups."""
    model_type = getattr(model.config, "model_type", None)
    if model_type not in QUANTIZABLE:
        raise ValueError(f"the quantizer takes {', '.join(QUANTIZABLE)} models, not {model_type!r}")
    kinds = set(getattr(model.config, "layer_types", None) or [])
    if len(kinds) > 1:
        raise ValueError(f"the quantizer calibrates every layer with one attention mask; this model's layers "
                         f"are of {len(kinds)} kinds ({', '.join(sorted(kinds))})")
    if group_size is not None:
        if group_size not in (32, 64, 128):
            raise ValueError(f"group size must be 32, 64 or 128 (AutoAWQ's GEMM sizes), got {group_size}")
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and ".layers." in name and module.in_features % group_size:
                raise ValueError(f"{name} has {module.in_features} inputs, not a whole number of groups of "
                                 f"{group_size}: choose a group size that divides it")
    for layer in decoder_layers(model):
        attn = getattr(layer, "self_attn", None)
        if attn is None or not all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
            raise ValueError("the quantizer needs separate q/k/v/o projections (Llama/Qwen/Mistral layout)")


def quantize_model(model: nn.Module, token_ids: torch.Tensor | None, group_size: int,
                   options: SearchOptions = SearchOptions()) -> dict[str, torch.Tensor]:
    """AWQ state dict (fp16 dense tensors; qweight/qzeros/scales per decoder linear) of `model`.

    `token_ids` [B, S] are the calibration rows; None: plain round-to-nearest. Modifies `model`
    in place (scales folded in; with `sequential`, decoder linears hold their dequantized weights)."""
    check_quantizable(model, group_size)
    if options.rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {options.rounding!r}")
    packed = search_model(model, token_ids, group_size, options) if token_ids is not None else {}
    return quantized_state(model, group_size, packed)


def search_model(model: nn.Module, token_ids: torch.Tensor, group_size: int,
                 options: SearchOptions) -> dict[int, tuple]:
    """Search, apply scales and quantize layer by layer; AWQ tensors per decoder linear (by id)."""
    inputs = first_layer_inputs(model, token_ids)
    packed: dict[int, tuple] = {}
    for layer in decoder_layers(model):
        output, features = run_layer(layer, inputs, capture=True)
        clips = search_layer(layer, inputs, features, group_size, options)
        packed.update(quantize_layer(layer, features, clips, group_size, options))
        if options.sequential:
            output, _ = run_layer(layer, inputs)
        inputs = LayerInputs(output, inputs.kwargs)
    return packed


def search_layer(layer: nn.Module, inputs: LayerInputs, features: dict[str, torch.Tensor], group_size: int,
                 options: SearchOptions) -> dict[str, torch.Tensor]:
    """Apply the best scales of each group of one layer (features rescaled to match); return
    clip factors [N, K/g] by linear name."""
    batch, seq = inputs.hidden.shape[:2]
    rows = min(batch, options.loss_rows) * seq
    for group in scale_groups(layer, inputs.kwargs):
        x = features[group.feature]                                                   # [B*S, K]
        block_input = x[:rows].reshape(-1, seq, x.shape[-1]) if group.block is not None else x[:rows]
        scales, _ = search_scale(group, block_input, group_size, grid=options.grid, duo=options.duo, stats=x)
        apply_scale(group.previous, group.linears, scales)
        features[group.feature] = x / scales.to(x.dtype)
    if not options.clip:
        return {}
    return {name: search_clip(layer.get_submodule(name).weight, features[feature], group_size, grid=options.grid)
            for name, feature in FEATURE_OF.items() if name not in NO_CLIP}


def quantize_layer(layer: nn.Module, features: dict[str, torch.Tensor], clips: dict[str, torch.Tensor],
                   group_size: int, options: SearchOptions) -> dict[int, tuple]:
    """AWQ tensors of each linear of one layer (by id); with `sequential`, weights become their
    dequantized values so the layer's output is the quantized layer's."""
    hessians = {f: second_moment(features[f]) for f in set(FEATURE_OF.values())} \
        if options.rounding == "feedback" else {}
    out = {}
    for name, feature in FEATURE_OF.items():
        linear = layer.get_submodule(name)
        if options.rounding == "feedback":
            rounded = feedback_round(linear.weight, hessians[feature], group_size, clips.get(name))
        else:
            rounded = round_groups(linear.weight, group_size, clips.get(name))
        out[id(linear)] = pack_groups(*rounded)
        if options.sequential:
            q, zeros, scales = rounded
            with torch.no_grad():
                linear.weight.copy_(((q - zeros[..., None]) * scales[..., None]).reshape(linear.weight.shape))
    return out


def quantized_state(model: nn.Module, group_size: int, packed: dict[int, tuple]) -> dict[str, torch.Tensor]:
    """The checkpoint tensors: AWQ triplets for decoder linears (from `packed`, else rounded to
    nearest), fp16 for everything else."""
    state: dict[str, torch.Tensor] = {}
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in n}
    for name, tensor in model.state_dict().items():
        prefix, _, leaf = name.rpartition(".")
        if prefix in quantized and leaf == "weight":
            triple = packed.get(id(quantized[prefix])) or quantize_groups(tensor, group_size)
            state.update(zip((f"{prefix}.qweight", f"{prefix}.qzeros", f"{prefix}.scales"), triple))
        else:
            state[name] = tensor.detach().to(torch.float16).contiguous()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return state


def save_checkpoint(model: nn.Module, state: dict[str, torch.Tensor], out: Path, group_size: int,
                    tokenizer_dir: Path | None = None) -> None:
    """Write config.json (with AutoAWQ's quantization_config), model.safetensors and tokenizer files.
    Written beside, then moved in, config.json last and the old one removed first: an interruption
    leaves `out` without a config (not a checkpoint), never an old config over part of new weights."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".awq-", dir=out))
    try:
        save_file(state, str(staging / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config["quantization_config"] = AWQConfig(4, group_size, True, "gemm").to_dict()
        config["dtype"] = "float16"
        (staging / "config.json").write_text(json.dumps(config, indent=2, default=str))
        for name in TOKENIZER_FILES if tokenizer_dir else ():
            if (tokenizer_dir / name).exists():
                shutil.copy(tokenizer_dir / name, staging / name)
        (out / "config.json").unlink(missing_ok=True)
        for path in sorted(staging.iterdir(), key=lambda p: p.name == "config.json"):
            os.replace(path, out / path.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Write an AWQ (GEMM, 4-bit) checkpoint of an HF model.")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default: the embedded model)")
    parser.add_argument("--group-size", type=int, default=32, choices=(32, 64, 128),
                        help="32, 64 or 128 (AutoAWQ's GEMM sizes)")
    parser.add_argument("--rows", type=int, default=32, help="calibration rows (0: plain round-to-nearest)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per calibration row")
    parser.add_argument("--loss-rows", type=int, default=DEFAULTS.loss_rows,
                        help="rows the scale search compares block outputs on")
    parser.add_argument("--grid", type=int, default=DEFAULTS.grid)
    parser.add_argument("--rounding", choices=ROUNDINGS, default=DEFAULTS.rounding)
    parser.add_argument("--no-clip", action="store_true", help="skip the range-clipping search")
    parser.add_argument("--sequential", action="store_true", help="each layer calibrates on the quantized layers before it")
    args = parser.parse_args(argv)
    problem = out_problem(args.out)         # checked before minutes of calibration, not after them
    if problem:
        parser.error(f"--out {args.out}: {problem}")
    from kvboost_engine import KVBoostError
    from kvboost_engine.loading import load_model_and_tokenizer, resolve_model_dir

    try:
        source = resolve_model_dir(args.model, "fp32")       # a .gguf as a float model (its layers as nn.Linear)
        model, tokenizer = load_model_and_tokenizer(source, device=torch.device("cpu"), dtype=torch.float32)
        check_quantizable(model, args.group_size)
        started = time.perf_counter()
        ids = calibration_ids(tokenizer, args.rows, args.seq_len) if args.rows else None
        options = SearchOptions(grid=args.grid, clip=not args.no_clip, rounding=args.rounding,
                                sequential=args.sequential, loss_rows=args.loss_rows)
        state = quantize_model(model, ids, args.group_size, options)
        save_checkpoint(model, state, args.out, args.group_size, Path(source) if isinstance(source, Path) else None)
    except (KVBoostError, ValueError, OSError) as err:     # a model not found or not quantizable, a full disk
        print(f"kvboost: {err}", file=sys.stderr)
        return 1
    print(f"wrote {args.out} in {time.perf_counter() - started:.0f} s")
    return 0


def out_problem(out: Path) -> str | None:
    """Why a checkpoint cannot be written to `out` (a file there, a folder that cannot be written), or None."""
    if out.exists() and not out.is_dir():
        return "exists and is not a folder"
    folder = out
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        return f"{folder} cannot be written"
    return None


if __name__ == "__main__":
    sys.exit(main())
