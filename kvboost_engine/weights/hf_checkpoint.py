"""transformers' float model of an HF checkpoint, refusing what it would load wrong without a word.

transformers fills a tensor the config needs but no file holds with random initial values (a load
report on stderr the only sign), and safetensors' error for a damaged file names no file. Here the
first is an InputError naming the tensor, the second one naming the file.
"""
from __future__ import annotations

from pathlib import Path

from ..errors import InputError
from ..model.building import building_model


def load_checkpoint(source: Path, config, dtype):
    """The model of the checkpoint in `source` built by transformers (under the build lock)."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM
    try:
        with building_model():
            model, info = AutoModelForCausalLM.from_pretrained(source, config=config, dtype=dtype, output_loading_info=True)
    except SafetensorError as err:
        raise InputError(f"{source}: {damaged_file(source) or err}") from err
    if info.get("missing_keys"):
        missing = sorted(info["missing_keys"])
        raise InputError(f"{source} lacks tensor {missing[0]} ({len(missing)} missing in all) that its config.json needs")
    return model


def damaged_file(folder: Path) -> str | None:
    """The first .safetensors file in `folder` whose header safetensors refuses, and why (None: all read)."""
    from safetensors import safe_open
    for path in sorted(Path(folder).glob("*.safetensors")):
        try:
            with safe_open(str(path), "pt"):
                pass
        except Exception as err:  # noqa: BLE001 - safetensors' own error types vary by version
            return f"{path.name} is damaged or cut short ({err})"
    return None
