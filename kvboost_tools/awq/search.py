"""Activation-aware scale search and range-clipping search for one decoder layer.

Scales (the AWQ paper's idea, our implementation): the input channels of a group of linears
that read the same tensor are multiplied by s and the op producing that tensor by 1/s, so the
float model is unchanged while channels with large activations lose less to rounding. s
interpolates between activation and weight magnitudes, `s = x_mean^a / w_mean^(1-a)`, and
the exponent a is chosen on a grid by the error of the block the linears feed (the attention
output for q/k/v, the MLP output for gate/up, the linear itself otherwise) on calibration
inputs. Clipping then shrinks each weight group's range where that lowers the error of the
group's contribution to the output (cross terms between channels included).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .grid import fake_quantize


@dataclass(slots=True)
class ScaleGroup:
    """Linears sharing one input, the op that produces it, and the block whose output is compared."""

    previous: nn.Module
    linears: list[nn.Linear]
    feature: str                              # key of the captured input in run_layer's features
    block: Callable[[torch.Tensor], torch.Tensor] | None = None    # input [B, S, K] -> output


def scale_groups(layer: nn.Module, attention_kwargs: dict) -> list[ScaleGroup]:
    """The scaling pairs of a Llama-style layer (o_proj only when it reads v_proj's full output)."""
    attn, mlp = layer.self_attn, layer.mlp
    kwargs = {k: v for k, v in attention_kwargs.items() if k != "position_ids"}
    groups = [ScaleGroup(layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj], "self_attn.q_proj",
                         lambda x: attn(x, **kwargs)[0]),
              ScaleGroup(layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj], "mlp.gate_proj", mlp)]
    if attn.v_proj.weight.shape == attn.o_proj.weight.shape:
        groups.append(ScaleGroup(attn.v_proj, [attn.o_proj], "self_attn.o_proj"))
    groups.append(ScaleGroup(mlp.up_proj, [mlp.down_proj], "mlp.down_proj"))
    return groups


def channel_means(x: torch.Tensor, linears: list[nn.Linear], group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean |x| per input channel [K], and mean |w| per input channel after scaling each weight
    group to max 1 [K] (how large a channel is relative to its group)."""
    x_mean = x.abs().float().mean(0)
    weight = torch.cat([m.weight.detach().float() for m in linears])                  # [sum N, K]
    groups = weight.abs().reshape(weight.shape[0], -1, group_size)
    w_norm = groups / groups.amax(dim=2, keepdim=True).clamp(min=1e-6)
    return x_mean, w_norm.reshape(weight.shape).mean(0)


def candidate_scales(x_mean: torch.Tensor, w_mean: torch.Tensor, ratio: float, duo: bool) -> torch.Tensor:
    """Input-channel scales [K] for exponent `ratio`, normalised to a geometric mean-ish of 1."""
    scales = x_mean.clamp(min=1e-6).pow(ratio)
    if duo:
        scales = scales / w_mean.clamp(min=1e-6).pow(1 - ratio)
    scales = scales.clamp(min=1e-4)
    return scales / (scales.max() * scales.min()).sqrt()


@torch.inference_mode()
def search_scale(group: ScaleGroup, x: torch.Tensor, group_size: int, *, grid: int = 20,
                 duo: bool = True, stats: torch.Tensor | None = None) -> tuple[torch.Tensor, list[float]]:
    """Best input-channel scales [K] for `group` on input `x` [B, S, K] (block inputs), and the
    block's mean squared error for: no scaling, then each grid exponent. No scaling wins ties,
    so the search never does worse than plain rounding on `x`. `stats` [T, K] (default: x)
    gives the channel statistics."""
    flat = x.reshape(-1, x.shape[-1])
    x_mean, w_mean = channel_means(flat if stats is None else stats, group.linears, group_size)
    forward = group.block or group.linears[0]
    originals = [m.weight.detach().clone() for m in group.linears]
    reference = forward(x).float()
    candidates = [torch.ones_like(x_mean)] + [candidate_scales(x_mean, w_mean, s / grid, duo) for s in range(grid)]
    errors = []
    try:
        for scales in candidates:
            for linear, weight in zip(group.linears, originals):
                w = weight.float() * scales
                linear.weight.copy_((fake_quantize(w, group_size) / scales).to(weight.dtype))
            errors.append((forward(x).float() - reference).pow(2).mean().item())
    finally:
        for linear, weight in zip(group.linears, originals):
            linear.weight.copy_(weight)
    return candidates[min(range(len(errors)), key=errors.__getitem__)], errors


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


@torch.inference_mode()
def search_clip(weight: torch.Tensor, x: torch.Tensor, group_size: int, *, grid: int = 20,
                max_shrink: float = 0.5, tokens: int = 512, rows_per_batch: int = 128) -> torch.Tensor:
    """Per-group range factors [N, K/g] in (1 - max_shrink) .. 1 minimising, for each output
    channel and group, the mean squared error of that group's contribution to the output on
    `tokens` evenly spaced rows of the input `x` [T, K]."""
    n, k = weight.shape
    sample = x[:: max(1, x.shape[0] // tokens)].float().reshape(-1, k // group_size, group_size)  # [T, G, g]
    best = torch.ones(n, k // group_size)
    for start in range(0, n, rows_per_batch):
        w = weight[start:start + rows_per_batch].float()                                       # [n, K]
        best[start:start + rows_per_batch] = _clip_rows(w, sample, group_size, grid, max_shrink)
    return best


def _clip_rows(w: torch.Tensor, sample: torch.Tensor, group_size: int, grid: int, max_shrink: float) -> torch.Tensor:
    n = w.shape[0]
    groups = w.reshape(n, -1, group_size)                                              # [n, G, g]
    reference = torch.einsum("tgc,ngc->ngt", sample, groups)                           # [n, G, T]
    best = torch.ones(n, groups.shape[1])
    best_err = torch.full_like(best, float("inf"))
    for step in range(int(max_shrink * grid) + 1):
        ratio = 1.0 - step / grid
        clip = torch.full_like(best, ratio)
        quantized = fake_quantize(w, group_size, clip).reshape_as(groups)
        err = (torch.einsum("tgc,ngc->ngt", sample, quantized) - reference).pow(2).mean(-1)   # [n, G]
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, clip, best)
    return best
