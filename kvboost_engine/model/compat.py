"""Every difference between the supported transformers versions, in one place.

Supported: transformers 4.56 to 5.x (tested: 4.56.2, the oldest, and 5.24.0, the newest).
4.56 is the floor because `dtype=` (instead of `torch_dtype=`) and the attention and rotary
interfaces the engine uses are all there from 4.56 on. What still differs:

- rope settings: v5 keeps them in `config.rope_parameters`; v4 in `rope_theta` + `rope_scaling`
  (+ `partial_rotary_factor` at top level). `rope_parameters(config)` gives the v5 form on both.
- building a config in code: `config_settings` turns v5-style settings into v4 ones (tests, tools).
- a model directory saved by v5 and read by v4: v4 ignores `rope_parameters` (rope_theta silently
  falls back to 10000) and does not know the `TokenizersBackend` tokenizer class.
  `fix_loaded_config` and `load_tokenizer` repair both; converted models are kept apart by
  transformers major version (`converted_dir_suffix`) so one version never reads the other's.
"""
from __future__ import annotations

import re
from importlib import metadata


def _version(text: str) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", text).groups()
    return int(major), int(minor)


# Read from the installed distribution: importing transformers here would slow every import.
TRANSFORMERS_VERSION = _version(metadata.version("transformers"))
V5 = TRANSFORMERS_VERSION >= (5, 0)
# 5.0-5.3: a top-level partial_rotary_factor (phi3's default 1.0) overwrites the one in rope_parameters.
_TOP_LEVEL_PARTIAL_ROTARY = V5 and TRANSFORMERS_VERSION < (5, 4)


def converted_dir_suffix() -> str:
    """Suffix of kvboost's converted-model folders: '' for transformers 5, '-tf4' for 4.x."""
    return "" if V5 else f"-tf{TRANSFORMERS_VERSION[0]}"


def rope_parameters(config) -> dict:
    """The rope settings in transformers 5's form (`rope_type`, `rope_theta`, scaling keys)."""
    if V5:
        return dict(getattr(config, "rope_parameters", None) or {})
    params = dict(getattr(config, "rope_scaling", None) or {})
    if "type" in params:                                   # the older spelling of rope_type
        params.setdefault("rope_type", params.pop("type"))
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    partial = getattr(config, "partial_rotary_factor", None)
    if partial is not None and partial != 1.0:
        params.setdefault("partial_rotary_factor", partial)
    return params


def config_settings(settings: dict, model_type: str) -> dict:
    """Config keyword arguments written the v5 way (`rope_parameters=`), as this version wants them."""
    settings = dict(settings)
    params = settings.pop("rope_parameters", None)
    if params is None:
        return settings
    params = dict(params)
    if V5:
        settings["rope_parameters"] = params
        if _TOP_LEVEL_PARTIAL_ROTARY and "partial_rotary_factor" in params:
            settings["partial_rotary_factor"] = params["partial_rotary_factor"]
        return settings
    settings["rope_theta"] = params.pop("rope_theta", 10000.0)
    if "partial_rotary_factor" in params:
        settings["partial_rotary_factor"] = params.pop("partial_rotary_factor")
    if params.get("rope_type", "default") == "default":
        return settings
    if model_type == "phi3":        # v4's Phi-3 wants exactly {type, short_factor, long_factor}
        if "original_max_position_embeddings" in params:
            settings["original_max_position_embeddings"] = params.pop("original_max_position_embeddings")
        params.pop("attention_factor", None)    # v4 derives it from the two lengths, as a GGUF's converter did
        params["type"] = params.pop("rope_type")
    settings["rope_scaling"] = params
    return settings


def fix_loaded_config(config):
    """A config read from a directory that transformers 5 saved, made right for this version
    (in place, before the model is built from it); a no-op on v5 and for v4-saved configs."""
    params = getattr(config, "rope_parameters", None)
    if V5 or not isinstance(params, dict) or not params:
        return config
    for key, value in config_settings({"rope_parameters": params}, config.model_type).items():
        setattr(config, key, value)
    del config.rope_parameters
    return config


def load_tokenizer(source, **kwargs):
    """`AutoTokenizer.from_pretrained`, falling back to the plain fast tokenizer for a directory
    saved by transformers 5 (tokenizer class `TokenizersBackend`, unknown to 4.x)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    try:
        return AutoTokenizer.from_pretrained(source, **kwargs)
    except ValueError as err:
        if V5 or "TokenizersBackend" not in str(err):
            raise
        return PreTrainedTokenizerFast.from_pretrained(source, **kwargs)
