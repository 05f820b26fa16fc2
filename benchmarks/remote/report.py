"""The remote benchmark's results as markdown tables (python -m benchmarks.remote.report FILE.json)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

TITLES = {"chat": "chat (long system prompt, interleaved conversations)",
          "chat-clock": "chat with a time + request-id line in the system prompt",
          "chat-docs": "chat, each conversation opening with its own 3 documents",
          "rag": "RAG (4 shuffled documents per question)"}


def markdown(results: dict) -> str:
    server = results["server"]
    lines = [f"Server: {server['kind']} serving `{server['model']}`; mode {results['mode']}; "
             f"load average {results['load_average']:.1f} -> {results.get('load_average_end', float('nan')):.1f} "
             f"on {results['cpu_count']} CPUs.", ""]
    lines += _table("One server: our layout (ChatKVBoost(endpoint=...)) vs ChatOpenAI, same conversation",
                    results.get("single", {}))
    if "replicas" in results:
        lines += _table("Two replicas, our layout: cache-aware routing vs round-robin", results["replicas"])
    return "\n".join(lines) + "\n"


def _table(title: str, phases: dict) -> list[str]:
    if not phases:
        return []
    lines = [f"**{title}**", "",
             "| workload | system | requests | prompt tokens | cached (usage) | hit rate | server hit rate "
             "| TTFT median | TTFT median after 1st | answers |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for workload, systems in phases.items():
        for name, data in systems.items():
            s = data["summary"]
            server = (s.get("server") or {}).get("hit_rate")
            answers = f"{s['answers_found']}/{s['requests']}" if "answers_found" in s else ""
            lines.append(f"| {TITLES.get(workload, workload)} | {name} | {s['requests']} | {s['prompt_tokens']} | "
                         f"{s['cached_tokens']} | {_pct(s['hit_rate'])} | {_pct(server)} | {s['ttft_median_s']:.3f} s | "
                         f"{_sec(s['ttft_median_after_first_s'])} | {answers} |")
    return lines + [""]


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _sec(value) -> str:
    return "-" if value is None else f"{value:.3f} s"


if __name__ == "__main__":
    print(markdown(json.loads(Path(sys.argv[1]).read_text())))
