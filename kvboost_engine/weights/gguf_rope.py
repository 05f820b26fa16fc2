"""The rotary scaling a GGUF file carries, put back into the model's config.

transformers' GGUF reader (5.24) takes only `<arch>.rope.freq_base` from a llama, qwen2, qwen3,
phi3 or gemma3 file, so a model whose rotary embedding is scaled loaded with plain frequencies:
other numbers than the model's at every position. llama.cpp's converter writes the scaling as:
- "llama3" (Llama 3.1 / 3.2 / 3.3): no metadata, a tensor `rope_freqs.weight` of one divisor per
  frequency (1 for the fast ones, `factor` for the slow ones, a smooth ramp between);
- linear (Gemma 3 4B and larger, on its global layers; some llama fine-tunes): `rope.scaling.type`
  "linear" and `rope.scaling.factor`;
- YaRN: "yarn", the factor, `rope.scaling.original_context_length` and, where the model set them,
  `yarn_beta_fast`, `yarn_beta_slow`, `yarn_attn_factor` (the HF `attention_factor`);
- "longrope" (Phi-3 128k): tensors `rope_factors_long.weight` / `rope_factors_short.weight`,
  `rope.scaling.attn_factor` and the original context length.
`scaled_rope` turns these back into the HF rope settings (transformers 5's `rope_parameters` form; a
"llama3" file's four settings are solved from its divisors, then checked by recomputing the divisors
as the converter does). A scaling it cannot put back exactly is refused (UnsupportedModelError):
loading it with plain frequencies would give another model's numbers without a word.
"""
from __future__ import annotations

import math

import numpy as np

from ..errors import UnsupportedModelError
from ..model import compat
from .gguf_blocks import dequantize
from .gguf_file import GGUFFile

LLAMA3_CONTEXT = 8192      # original_max_position_embeddings written for a solved "llama3" scaling: its
                           # divisors fix only context / low_freq_factor and context / high_freq_factor
DIVISOR_RTOL = 1e-5        # which divisors are 1 and which the factor (the converter computes them in float32)
FIT_RTOL = 3e-6            # solved settings must give the file's divisors this closely


def apply_gguf_rope(config, file: GGUFFile) -> None:
    """Put `file`'s rotary scaling into `config` (in place; nothing where the file has none)."""
    params = compat.rope_parameters(config)
    nested = "full_attention" in params          # Gemma 3 on transformers 5: settings per layer type
    target = dict(params["full_attention"] if nested else params)
    scaling = scaled_rope(file, target, _rope_dim(config))
    if scaling is None:
        return
    if nested:
        params = {**params, "full_attention": scaling}
    else:
        params = scaling
    if compat.V5:
        config.rope_parameters = params
        original = scaling.get("original_max_position_embeddings")
        if original is not None and hasattr(config, "original_max_position_embeddings"):
            config.original_max_position_embeddings = original    # Phi-3's own field: read back over rope_parameters'
        return
    for key, value in compat.config_settings({"rope_parameters": params}, config.model_type).items():
        setattr(config, key, value)


def scaled_rope(file: GGUFFile, base: dict, rope_dim: int) -> dict | None:
    """`base` (rope settings with `rope_theta`) with the file's scaling, or None where it has none."""
    arch = file.architecture
    key = f"{arch}.rope.scaling."
    kind = file.field(key + "type")
    kind = kind.lower() if isinstance(kind, str) else None
    theta = float(base.get("rope_theta", 10000.0))
    if "rope_freqs.weight" in file.tensors:
        if kind not in (None, "none"):
            raise UnsupportedModelError(f"{file.path}: both rope_freqs and rope scaling type {kind!r}")
        return {**base, **llama3_settings(_floats(file, "rope_freqs.weight"), theta, rope_dim, file.path)}
    if kind in (None, "none"):
        return None
    factor = file.field(key + "factor")
    original = file.field(key + "original_context_length")
    if kind == "linear":
        return {**base, "rope_type": "linear", "factor": float(_required(factor, key + "factor", file))}
    if kind == "yarn":
        ext = file.field(key + "yarn_ext_factor")
        if ext is not None and float(ext) != 1.0:
            raise UnsupportedModelError(f"{file.path}: YaRN with yarn_ext_factor {ext} (transformers' YaRN has none)")
        if file.field(key + "yarn_log_multiplier") is not None:
            raise UnsupportedModelError(f"{file.path}: YaRN with yarn_log_multiplier is not supported")
        out = {**base, "rope_type": "yarn", "factor": float(_required(factor, key + "factor", file))}
        if original is not None:
            out["original_max_position_embeddings"] = int(original)
        for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                                 ("yarn_attn_factor", "attention_factor")):
            if file.field(key + gguf_key) is not None:
                out[hf_key] = float(file.field(key + gguf_key))
        return out
    if kind == "longrope":
        if "rope_factors_long.weight" not in file.tensors or "rope_factors_short.weight" not in file.tensors:
            raise UnsupportedModelError(f"{file.path}: longrope scaling without its rope_factors_long / _short tensors")
        out = {**base, "rope_type": "longrope",
               "long_factor": _floats(file, "rope_factors_long.weight").tolist(),
               "short_factor": _floats(file, "rope_factors_short.weight").tolist(),
               "original_max_position_embeddings": int(_required(original, key + "original_context_length", file))}
        attn = file.field(key + "attn_factor")
        if attn is not None:
            out["attention_factor"] = float(attn)
        return out
    raise UnsupportedModelError(f"{file.path}: rope scaling type {kind!r} is not supported "
                                "(supported: linear, yarn, longrope, and llama3's rope_freqs)")


def llama3_settings(divisors: np.ndarray, theta: float, rope_dim: int, where="") -> dict:
    """The "llama3" settings whose divisors (one per frequency, as llama.cpp's converter computes them
    from factor, low_freq_factor, high_freq_factor and original_max_position_embeddings) are
    `divisors`. Frequencies with divisor 1 are the fast ones, those with the largest the slow ones;
    those between follow 1 / d = (1 - s) / factor + s with s linear in 1 / wavelength, which gives
    the two thresholds. Refused where no such settings give these divisors."""
    divisors = np.asarray(divisors, dtype=np.float64)
    if divisors.shape != (rope_dim // 2,):
        raise UnsupportedModelError(f"{where}: rope_freqs has {divisors.size} values for a rotary dimension of {rope_dim}")
    freqs = 1.0 / theta ** (np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
    wavelen = 2 * math.pi / freqs                             # increasing
    factor = float(divisors.max())
    if factor <= 1.0 + DIVISOR_RTOL or divisors.min() < 1.0 - DIVISOR_RTOL:
        raise UnsupportedModelError(f"{where}: rope_freqs {divisors.min():.4g}..{factor:.4g} are not llama3 divisors")
    fast = np.isclose(divisors, 1.0, rtol=DIVISOR_RTOL)
    slow = np.isclose(divisors, factor, rtol=DIVISOR_RTOL)
    ramp = ~fast & ~slow
    if ramp.sum() >= 2:
        # s = (context / wavelen - low) / (high - low): a line in 1 / wavelen through the ramp's points
        s = (1.0 / divisors[ramp] - 1.0 / factor) / (1.0 - 1.0 / factor)
        slope, icept = np.polyfit(1.0 / wavelen[ramp], s, 1)
        if slope <= 0:
            raise UnsupportedModelError(f"{where}: rope_freqs are not llama3 divisors (they fall where its ramp rises)")
        low_wavelen = -slope / icept if icept < 0 else math.inf       # s = 0 there
        high_wavelen = slope / (1.0 - icept)                           # s = 1 there
    else:
        # at most one frequency on the ramp: any thresholds around it give the same divisors; this
        # takes the ones halfway (in log wavelength) between the neighbouring frequencies
        last_fast = wavelen[fast].max() if fast.any() else wavelen[0] / 2
        first_slow = wavelen[slow].min()
        on_ramp = wavelen[ramp]
        if on_ramp.size:
            w, d = float(on_ramp[0]), float(divisors[ramp][0])
            high_wavelen = math.sqrt(last_fast * w)
            s = (1.0 / d - 1.0 / factor) / (1.0 - 1.0 / factor)
            # the line in 1 / wavelength through (1 / high_wavelen, 1) and (1 / w, s); s = 0 past it
            slope = (1.0 - s) / (1.0 / high_wavelen - 1.0 / w)
            icept = 1.0 - slope / high_wavelen
            low_wavelen = -slope / icept if icept < 0 else math.inf
        else:
            high_wavelen = low_wavelen = math.sqrt(last_fast * first_slow)
    if not (math.isfinite(low_wavelen) and low_wavelen >= high_wavelen > 0):
        raise UnsupportedModelError(f"{where}: rope_freqs are not llama3 divisors (no consistent thresholds)")
    out = {"rope_type": "llama3", "rope_theta": theta, "factor": factor,
           "low_freq_factor": LLAMA3_CONTEXT / low_wavelen, "high_freq_factor": LLAMA3_CONTEXT / high_wavelen,
           "original_max_position_embeddings": LLAMA3_CONTEXT}
    if out["high_freq_factor"] == out["low_freq_factor"]:
        out["high_freq_factor"] *= 1 + 1e-9               # the ramp's formula divides by their difference
    # the settings a config would write (1.0 and 4.0, not 1.0000001 and 3.9999999) where they give the
    # same divisors
    rounded = {**out, **{k: round(out[k], 6) for k in ("low_freq_factor", "high_freq_factor")}}
    for candidate in (rounded, out):
        again = llama3_divisors(candidate, rope_dim)
        if candidate["high_freq_factor"] > candidate["low_freq_factor"] > 0 and \
                np.allclose(again, divisors, rtol=FIT_RTOL, atol=0):
            return candidate
    worst = float(np.max(np.abs(llama3_divisors(out, rope_dim) / divisors - 1)))
    raise UnsupportedModelError(f"{where}: rope_freqs are not llama3 divisors (best fit off by {worst:.2g})")


def llama3_divisors(settings: dict, rope_dim: int) -> np.ndarray:
    """The divisors llama.cpp's converter writes as rope_freqs for "llama3" settings (float64)."""
    freqs = 1.0 / settings["rope_theta"] ** (np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
    context = settings["original_max_position_embeddings"]
    low, high, factor = settings["low_freq_factor"], settings["high_freq_factor"], settings["factor"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < context / high:
            out.append(1.0)
        elif wavelen > context / low:
            out.append(factor)
        else:
            s = (context / wavelen - low) / (high - low)
            out.append(1 / ((1 - s) / factor + s))
    return np.array(out)


def _rope_dim(config) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    partial = compat.rope_parameters(config).get("partial_rotary_factor", 1.0)
    return int(head_dim * partial)


def _floats(file: GGUFFile, name: str) -> np.ndarray:
    return dequantize(file.tensors[name]).float().reshape(-1).numpy().astype(np.float64)


def _required(value, key: str, file: GGUFFile):
    if value is None:
        raise UnsupportedModelError(f"{file.path}: rope scaling without {key}")
    return value
