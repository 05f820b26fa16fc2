"""Load test of our OpenAI-compatible server: one server process, several client processes.

    python -m benchmarks.serve.load [--quick] [--mode server|embedded|both] [--clients 4] [--streams 8]
                                    [--requests 12] [--max-tokens 24] [--seed 0] [--cache-bytes 256MiB]
                                    [--out benchmarks/results/serve_load.json]

Starts `python -m kvboost_engine.serve` (the default model, fp32, on 127.0.0.1, a free port) as a
subprocess, then `--clients` client processes (multiprocessing, spawned), each with `--streams`
concurrent streams (asyncio, the openai client) running `--requests` requests each: chat turns,
RAG questions with two QA-set documents as document parts, streams cancelled after two deltas, and
clients that stop waiting after 0.3 s and drop the connection (benchmarks/serve/workload.py).

Recorded: errors other than the intended refusals (429/503; must be 0); leaked KV (the server's
/metrics `kvboost_kv_bytes{holder="in_use"}` and `kvboost_requests_running` once the clients are
done: must return to 0); the server's RSS sampled every 0.5 s (flat after warm-up); TTFT p50/p99
(from the call to the first text delta, all completed streams, and "warm" ones: with cached prompt
tokens); aggregate completion tokens/s of completed requests over the load's wall time; the cache
hit rate (cached / prompt tokens of completed requests); the client processes' peak RSS, summed.
OMP_WAIT_POLICY is PASSIVE unless set (recorded): spinning OpenMP threads stall on a busy machine.

`--mode embedded` runs the same workload with no server: each client process loads its own Engine
(torch threads: CPU count / clients, at least 1) and runs its streams on threads
(benchmarks/serve/embedded.py); `--mode both` runs the server first, then the embedded engines.
`--mode llama-server` runs it against llama-server (built by `bash .ci/remote.sh`) on the same GGUF
(Q4_1 as stored: our server dequantizes it to fp32), one slot per stream of a client (`-np`), its
prompt cache on, document parts sent as text; `--mode all` runs the three in turn.
`--quick`: 2 clients x 4 streams x 3 requests.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import threading
import time
import urllib.request

from kvboost_tools.servers import free_port

from .clients import new_outcome, run_client
from .embedded import run_embedded_client
from .workload import percentiles

READY_TIMEOUT_S = 300
DRAIN_WAIT_S = 30
EMBEDDED_TIMEOUT_S = 3600       # longest wait for an embedded client process's outcome


def start_server(port: int, cache_bytes: str | None = None) -> subprocess.Popen:
    """Our server on 127.0.0.1:port (default model, fp32), once /health answers ok."""
    command = [sys.executable, "-m", "kvboost_engine.serve", "--port", str(port), "--dtype", "float32",
               "--log-level", "warning", *(["--cache-bytes", cache_bytes] if cache_bytes else [])]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}: {process.stderr.read()[-2000:]}")
        try:
            if json.loads(_get(port, "/health")).get("status") == "ok":
                return process
        except OSError:
            time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"the server did not answer /health within {READY_TIMEOUT_S} s")


def _get(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as reply:
        return reply.read().decode()


def gauges(port: int) -> dict[str, float]:
    """The server's /metrics samples without labels, plus kv_bytes.<holder>."""
    out = {}
    for line in _get(port, "/metrics").splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        if name.startswith('kvboost_kv_bytes{holder="'):
            out["kv_bytes." + name.split('"')[1]] = float(value)
        elif "{" not in name:
            out[name] = float(value)
    return out


def rss_of(pid: int) -> int:
    """Resident bytes of process `pid` (Linux /proc; 0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class RssSampler:
    """Samples a process's RSS every `every_s` seconds on a thread: [(seconds, RSS MiB, cached KV MiB)]
    (the server's RSS grows with its KV cache until the cache budget is reached: RSS minus cached KV
    is what must stay flat)."""

    def __init__(self, pid: int, port: int | None, every_s: float = 0.5):
        self.pid, self.port, self.every_s, self.samples = pid, port, every_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._started = time.perf_counter()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                cached = gauges(self.port).get("kv_bytes.cached", 0) / 2**20 if self.port else 0.0
            except OSError:
                cached = float("nan")
            self.samples.append((round(time.perf_counter() - self._started, 2), round(rss_of(self.pid) / 2**20, 1),
                                 round(cached, 1)))
            self._stop.wait(self.every_s)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def merge(outcomes: list[dict]) -> dict:
    total = new_outcome()
    for outcome in outcomes:
        for key, value in outcome.items():
            if key in total:
                total[key] = total[key] + value
    return total


def summarize(total: dict, seconds: float) -> dict:
    """The figures of a run from its merged outcome."""
    return {
        "requests": {k: total[k] for k in ("completed", "cancelled", "disconnected", "refused")},
        "errors": len(total["errors"]), "error_samples": total["errors"][:10],
        "ttft_s": percentiles(total["ttft_s"]), "warm_ttft_s": percentiles(total["warm_ttft_s"]),
        "completion_tokens": total["completion_tokens"], "seconds": round(seconds, 2),
        "tokens_per_s": round(total["completion_tokens"] / seconds, 2) if seconds else None,
        "cache_hit_rate": round(total["cached_tokens"] / total["prompt_tokens"], 3) if total["prompt_tokens"] else None,
        "client_rss_mib_total": round(total["rss_mib"], 1),
    }


def run_clients(target, args: argparse.Namespace, extra: tuple, *after) -> tuple[list[dict], float]:
    """`args.clients` spawned processes each running `target(*extra, client, streams, requests, seed,
    max_tokens, *after)`; their outcomes and the wall time until the last one finished."""
    context = multiprocessing.get_context("spawn")
    jobs = [(*extra, client, args.streams, args.requests, args.seed, args.max_tokens, *after)
            for client in range(args.clients)]
    started = time.perf_counter()
    with context.Pool(args.clients) as pool:
        outcomes = pool.starmap(target, jobs)
    return outcomes, time.perf_counter() - started


def serve_run(args: argparse.Namespace) -> dict:
    """The workload against one server process."""
    port = free_port()
    server = start_server(port, args.cache_bytes)
    try:
        model = json.loads(_get(port, "/v1/models"))["data"][0]["id"]
        with RssSampler(server.pid, port) as rss:
            outcomes, seconds = run_clients(run_client, args, (f"http://127.0.0.1:{port}/v1", model))
            after = settle(port)
        result = summarize(merge(outcomes), seconds)
        result["after_clients"] = after
        mib = [m for _, m, _ in rss.samples]
        beyond_kv = [m - kv for _, m, kv in rss.samples]
        result["server_rss_mib"] = {"first": mib[0], "max": max(mib), "last": mib[-1],
                                    "minus_cached_kv": {"first": beyond_kv[0], "max": round(max(beyond_kv), 1),
                                                        "last": beyond_kv[-1]},
                                    "samples": rss.samples[:: max(1, len(rss.samples) // 200)]}
        return result
    finally:
        server.terminate()
        try:
            server.wait(DRAIN_WAIT_S + 10)
        except subprocess.TimeoutExpired:
            server.kill()


def llama_run(args: argparse.Namespace) -> dict:
    """The workload against llama-server (built by .ci/remote.sh) on the same GGUF, Q4_1 as stored:
    one slot per concurrent stream of a client (`-np`), its prompt cache on, all cores; document parts
    sent as text (it knows none)."""
    from kvboost_tools.servers import SERVED_NAME, start_llama_server
    slots = args.streams
    with start_llama_server(slots=slots, context=2048 * slots, threads=os.cpu_count() or 1) as server:
        with RssSampler(server.process.pid, None) as rss:
            outcomes, seconds = run_clients(run_client, args, (server.url, SERVED_NAME), True)
        result = summarize(merge(outcomes), seconds)
        mib = [m for _, m, _ in rss.samples]
        result["server_rss_mib"] = {"first": mib[0], "max": max(mib), "last": mib[-1]}
        result["slots"] = slots
        return result


def embedded_run(args: argparse.Namespace) -> dict:
    """The workload on one embedded engine per client process (no server)."""
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(args.clients), context.Queue()
    threads = max(1, (os.cpu_count() or 1) // args.clients)
    processes = [context.Process(target=run_embedded_client, args=(barrier, results, threads, client, args.streams,
                                                                     args.requests, args.seed, args.max_tokens))
                 for client in range(args.clients)]
    for process in processes:
        process.start()
    outcomes = [results.get(timeout=EMBEDDED_TIMEOUT_S) for _ in processes]
    for process in processes:
        process.join()
    timed = [o for o in outcomes if "started" in o]
    seconds = max(o["ended"] for o in timed) - min(o["started"] for o in timed) if timed else 0.0
    result = summarize(merge(outcomes), seconds)
    result["torch_threads_per_process"] = threads
    return result


def settle(port: int) -> dict:
    """Wait (up to DRAIN_WAIT_S) for in-use KV and running requests to return to 0; the gauges then."""
    deadline = time.monotonic() + DRAIN_WAIT_S
    while True:
        now = gauges(port)
        if (now.get("kv_bytes.in_use", 0) == 0 and now.get("kvboost_requests_running", 0) == 0) \
                or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    keep = ("kv_bytes.in_use", "kv_bytes.cached", "kv_bytes.pool", "kvboost_requests_running",
            "kvboost_requests_waiting", "kvboost_prompt_tokens_total", "kvboost_generation_tokens_total")
    return {key: now.get(key) for key in keep}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serve.load", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="2 clients x 4 streams x 3 requests")
    p.add_argument("--mode", choices=("server", "embedded", "both", "llama-server", "all"), default="server",
                   help="our server (default), one embedded engine per client process, both in turn, llama-server "
                        "on the same GGUF (built by .ci/remote.sh), or all three in turn")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--streams", type=int, default=8, help="concurrent streams per client process")
    p.add_argument("--requests", type=int, default=12, help="requests per stream")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-bytes", default=None, help="the server's KV cache budget, e.g. 256MiB (default: the "
                   "engine's); a budget the run fills shows RSS at its plateau")
    p.add_argument("--out", default=None)
    return p


def main(argv=None) -> dict:
    args = parser().parse_args(argv)
    if args.quick:
        args.clients, args.streams, args.requests = 2, 4, 3
    from .._common import save_result
    # OpenMP threads that spin at barriers slow a multi-thread engine 10-100x on a busy machine;
    # passive waiting unless the caller chose (inherited by the server and the client processes)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    settings = {k: getattr(args, k) for k in ("mode", "clients", "streams", "requests", "max_tokens", "seed", "quick",
                                                "cache_bytes")}
    machine = {"cpu_count": os.cpu_count(), "load_average": os.getloadavg()[0],
               "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset")}
    result = {"settings": settings, "machine": machine}
    if args.mode in ("server", "both", "all"):
        result["server"] = serve_run(args)
    if args.mode in ("embedded", "both", "all"):
        result["embedded"] = embedded_run(args)
    if args.mode in ("llama-server", "all"):
        result["llama_server"] = llama_run(args)
    result["machine"]["load_average_after"] = os.getloadavg()[0]
    path = save_result(result, args.out, "serve_load_quick" if args.quick else "serve_load")
    for mode in ("server", "embedded", "llama_server"):
        if mode in result:
            shown = {k: v for k, v in result[mode].items() if k != "server_rss_mib"}
            print(f"{mode}: {json.dumps(shown)}")
    if "server" in result:
        print(f"server RSS MiB: {result['server']['server_rss_mib'] | {'samples': '...'}}")
    print(f"written to {path}")
    return result


if __name__ == "__main__":
    main()
