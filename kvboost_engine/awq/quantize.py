"""A small AWQ quantizer of our own: writes AutoAWQ's GEMM checkpoint format.

Activation-aware scaling and range clipping as in the AWQ paper, simplified: per group of linears sharing an
input (q/k/v after the input norm, gate/up after the post-attention norm, down after up,
o after v when shapes allow), input channels are scaled by `mean|x| ** alpha` before
round-to-nearest 4-bit quantization, alpha chosen on a grid to minimise the group's output
error on calibration activations; the inverse scale is folded into the preceding op, so the
float model is unchanged. Calibration inputs come from one pass of the float model.

    python -m kvboost_engine.awq.quantize --out DIR [--model DIR] [--group-size 64]
"""
from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from .format import AWQConfig, fake_quantize, quantize_groups
from .texts import calibration_texts

GRID = 20
CLIP_GRID = 10
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                   "special_tokens_map.json", "vocab.json", "merges.txt")


def scale_groups(layer: nn.Module) -> list[tuple[nn.Module, list[nn.Linear], str]]:
    """(preceding op, linears sharing its output, name of the linear whose input is captured)."""
    attn, mlp = layer.self_attn, layer.mlp
    groups = [(layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj], "q_proj"),
              (layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj], "gate_proj"),
              (mlp.up_proj, [mlp.down_proj], "down_proj")]
    if attn.v_proj.out_features == attn.o_proj.in_features:
        groups.append((attn.v_proj, [attn.o_proj], "o_proj"))
    return groups


def check_quantizable(model: nn.Module) -> None:
    for layer in model.model.layers:
        attn = getattr(layer, "self_attn", None)
        if attn is None or not all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
            raise ValueError("the quantizer needs separate q/k/v/o projections (Llama/Qwen/Mistral layout)")


@torch.inference_mode()
def capture_inputs(model: nn.Module, token_ids: torch.Tensor) -> dict[int, dict[str, torch.Tensor]]:
    """Inputs [T, K] of q_proj, o_proj, gate_proj and down_proj of every layer for `token_ids` [B, S]."""
    captured: dict[int, dict[str, torch.Tensor]] = {}
    handles = []
    for index, layer in enumerate(model.model.layers):
        for name, module in (("q_proj", layer.self_attn.q_proj), ("o_proj", layer.self_attn.o_proj),
                             ("gate_proj", layer.mlp.gate_proj), ("down_proj", layer.mlp.down_proj)):
            def hook(mod, args, index=index, name=name):
                captured.setdefault(index, {}).setdefault(name, []).append(
                    args[0].reshape(-1, args[0].shape[-1]).half())
            handles.append(module.register_forward_pre_hook(hook))
    try:
        for row in token_ids:
            model(row[None])
    finally:
        for handle in handles:
            handle.remove()
    return {i: {k: torch.cat(v) for k, v in d.items()} for i, d in captured.items()}   # fp16 to halve memory


@torch.inference_mode()
def search_scale(linears: list[nn.Linear], x: torch.Tensor, group_size: int) -> torch.Tensor:
    """Input-channel scales [K] minimising the group's quantized output error on `x` [T, K]."""
    weight = torch.cat([m.weight.float() for m in linears])                          # [sum N, K]
    reference = x @ weight.T
    act = x.abs().mean(0).clamp(min=1e-6)
    best, best_err = torch.ones_like(act), float("inf")
    for step in range(GRID):
        scales = act.pow(step / GRID)
        scales = scales / (scales.max() * scales.min()).sqrt()
        err = (x @ (fake_quantize(weight * scales, group_size) / scales).T - reference).pow(2).mean().item()
        if err < best_err:
            best, best_err = scales, err
    return best


@torch.inference_mode()
def search_clip(weight: torch.Tensor, x_sq: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per-group range factors [N, K/g] (1.0 .. 0.5) minimising the activation-weighted error
    sum_k mean(x_k^2) (w - w_q)^2 of each group; `x_sq` [K] is the mean squared input."""
    w = weight.float()
    n, k = w.shape
    best_err = torch.full((n, k // group_size), float("inf"))
    best = torch.ones(n, k // group_size)
    for step in range(CLIP_GRID):
        ratio = 1.0 - 0.5 * step / CLIP_GRID
        clip = torch.full_like(best, ratio)
        err = ((w - fake_quantize(w, group_size, clip)).pow(2) * x_sq).reshape(n, -1, group_size).sum(-1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, clip, best)
    return best


@torch.inference_mode()
def apply_scale(previous: nn.Module, linears: list[nn.Linear], scales: torch.Tensor) -> None:
    """Fold 1/scales into the preceding op's output and scales into the linears' inputs."""
    if isinstance(previous, nn.Linear):
        previous.weight.div_(scales[:, None].to(previous.weight.dtype))
        if previous.bias is not None:
            previous.bias.div_(scales.to(previous.bias.dtype))
    else:
        previous.weight.div_(scales.to(previous.weight.dtype))
    for linear in linears:
        linear.weight.mul_(scales[None, :].to(linear.weight.dtype))


def quantize_model(model: nn.Module, token_ids: torch.Tensor | None, group_size: int,
                   clip: bool = False) -> dict[str, torch.Tensor]:
    """AWQ state dict (fp16 dense tensors; qweight/qzeros/scales per decoder linear) of `model`.

    With `token_ids` None, no search (plain round-to-nearest). `clip` adds the range-clipping
    search (off by default: on the default model it raised perplexity, 18.96 vs 18.49).
    Modifies `model` in place.
    """
    check_quantizable(model)
    inputs = capture_inputs(model, token_ids) if token_ids is not None else {}
    clips: dict[int, torch.Tensor] = {}
    for index, layer in enumerate(model.model.layers):
        if inputs:
            clips.update(_search_layer(layer, inputs.pop(index), group_size, clip))
    state: dict[str, torch.Tensor] = {}
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in n}
    for name, tensor in model.state_dict().items():
        prefix, _, leaf = name.rpartition(".")
        if prefix in quantized and leaf == "weight":
            qweight, qzeros, scales = quantize_groups(tensor, group_size, clips.get(id(quantized[prefix])))
            state.update({f"{prefix}.qweight": qweight, f"{prefix}.qzeros": qzeros, f"{prefix}.scales": scales})
        else:
            state[name] = tensor.detach().to(torch.float16).contiguous()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return state


def _search_layer(layer: nn.Module, inputs: dict[str, torch.Tensor], group_size: int,
                  clip: bool) -> dict[int, torch.Tensor]:
    """Apply the best input scales of each group of one layer; return clip factors per linear (by id)."""
    clips = {}
    scaled = set()
    for previous, linears, name in scale_groups(layer):
        x = inputs[name].float()
        scales = search_scale(linears, x, group_size)
        apply_scale(previous, linears, scales)
        x_sq = (x / scales).pow(2).mean(0)
        for linear in linears if clip else ():
            clips[id(linear)] = search_clip(linear.weight, x_sq, group_size)
        scaled.update(id(linear) for linear in linears)
    o_proj = layer.self_attn.o_proj
    if clip and id(o_proj) not in scaled:
        clips[id(o_proj)] = search_clip(o_proj.weight, inputs["o_proj"].float().pow(2).mean(0), group_size)
    return clips


def save_checkpoint(model: nn.Module, state: dict[str, torch.Tensor], out: Path, group_size: int,
                    tokenizer_dir: Path | None = None) -> None:
    """Write config.json (with AutoAWQ's quantization_config), model.safetensors and tokenizer files."""
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["quantization_config"] = AWQConfig(4, group_size, True, "gemm").to_dict()
    config["dtype"] = "float16"
    (out / "config.json").write_text(json.dumps(config, indent=2, default=str))
    for name in TOKENIZER_FILES if tokenizer_dir else ():
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)


def calibration_ids(tokenizer, samples: int, seq_len: int = 256, max_tokens: int = 1024) -> torch.Tensor:
    """[B, seq_len] token ids (at most max_tokens) from the fixed calibration paragraphs."""
    ids = [t for text in calibration_texts(samples) for t in tokenizer(text)["input_ids"]]
    rows = max(1, min(len(ids), max_tokens) // seq_len)
    return torch.tensor(ids[:rows * seq_len]).reshape(rows, seq_len)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Write an AWQ (GEMM, 4-bit) checkpoint of an HF model.")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default: the embedded model)")
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--samples", type=int, default=64, help="calibration paragraphs (0: no scale search)")
    parser.add_argument("--clip", action="store_true", help="also search per-group range clipping")
    args = parser.parse_args(argv)
    from ..loading import load_model_and_tokenizer, resolve_model_dir

    source = resolve_model_dir(args.model)
    model, tokenizer = load_model_and_tokenizer(source, device=torch.device("cpu"), dtype=torch.float32)
    started = time.perf_counter()
    ids = calibration_ids(tokenizer, args.samples) if args.samples else None
    state = quantize_model(model, ids, args.group_size, clip=args.clip)
    save_checkpoint(model, state, args.out, args.group_size, Path(source) if isinstance(source, Path) else None)
    print(f"wrote {args.out} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
