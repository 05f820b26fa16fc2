"""Side-by-side results -> markdown tables, PNG plots, and the README's results section.

    python -m benchmarks.sidebyside.report [--json benchmarks/results/sidebyside.json] [--readme]

The README section between the markers below is always generated from a results JSON, so the
numbers there come from a run of `python -m benchmarks`.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from .aggregate import sequence_median, series

BEGIN, END = "<!-- kvboost:results:begin -->", "<!-- kvboost:results:end -->"
ROOT = Path(__file__).resolve().parents[2]      # the repository (this file: benchmarks/sidebyside/)
MIB = 1024**2
PLOTS = ("ttft_vs_turn", "hit_rate_vs_turn", "ttft_vs_docs", "coding_ttft")


def _llamacpp_note(result: dict) -> str:
    if not any(s.startswith("llamacpp") for s in result["systems"]):
        return ""
    return ("llama.cpp rows run the Q4_1 GGUF the fp32 model was dequantized from (integer kernels: replies can "
            "differ by rounding), with llama-cpp-python's RAM prompt cache; their \"reused\" is the prefix "
            f"llama-cpp-python itself skips (live context or cache entry); OMP_WAIT_POLICY "
            f"{result['environment'].get('omp_wait_policy', 'unset')}. ")


def _suffix(result) -> str:
    model = result.get("model", "default")
    return ("" if model == "default" else f"-{model}") + ("-quick" if result["mode"] == "quick" else "")


def ran(result) -> list[str]:
    return [s for s, info in result["systems"].items() if info["status"] == "ran"]


def rows_of(result, system_id: str, workload: str) -> dict:
    return result["groups"][result["group_of"][system_id]][system_id][workload]


def _ms(spread) -> str:
    if spread["median"] is None:
        return "–"
    return f"{spread['median'] * 1e3:.0f} ({spread['min'] * 1e3:.0f}–{spread['max'] * 1e3:.0f})"


def _x(spread) -> str:
    if not spread or spread["median"] is None:
        return "–"
    return f"{spread['median']:.2f}× ({spread['min']:.2f}–{spread['max']:.2f})"


def _rate(spread) -> str:
    return "–" if spread["median"] is None else f"{spread['median']:.1f} ({spread['min']:.1f}–{spread['max']:.1f})"


def _pct(value) -> str:
    return "–" if value is None else f"{100 * value:.0f}%"


def _label(result, system_id: str) -> str:
    info = result["systems"][system_id]
    text = f"{info['label']} {info['version']}" if not system_id.startswith("ours") else info["label"]
    return text + (" †" if result["group_of"][system_id] == "worker" else "")


def workload_table(result, workload: dict) -> list[str]:
    name = workload["name"]
    rag = name == "rag"
    head = ["system", "TTFT ms (min–max)", "TTFT speedup vs transformers", "total ms / request", "decode tok/s",
            "prompt reused", "same reply as transformers"] + (["answer correct"] if rag else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for system_id, info in result["systems"].items():
        if info["status"] != "ran":
            lines.append(f"| {_label(result, system_id)} | {info['status']} |" + " |" * (len(head) - 2))
            continue
        s = rows_of(result, system_id, name)["summary"]
        cells = [_label(result, system_id), _ms(s["ttft_s"]), _x(s.get("ttft_speedup")), _ms(s["total_s"]),
                 _rate(s["decode_tok_s"]), _pct(s["reused_share"]), _pct(s.get("agreement"))]
        if rag:
            cells.append(_pct(s.get("accuracy")))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def rag_by_docs(result, workload: dict) -> list[str]:
    keys = [(seq["key"], seq["x"]) for seq in workload["sequences"]]
    lines = ["| system | " + " | ".join(f"{x} doc{'s' if x > 1 else ''}" for _, x in keys) + " |",
             "|---|" + "---|" * len(keys)]
    for system_id in ran(result):
        seqs = rows_of(result, system_id, "rag")["sequences"]
        cells = [f"{sequence_median(seqs[key], 'ttft_s') * 1e3:.0f}" for key, _ in keys]
        lines.append(f"| {_label(result, system_id)} | " + " | ".join(cells) + " |")
    return lines


def memory_table(result) -> list[str]:
    lines = ["| system | peak RSS MiB | RSS after model load MiB |", "|---|---|---|"]
    for system_id in ran(result):
        mem = result["systems"][system_id].get("memory") or {}
        if "peak_rss_bytes" not in mem:
            lines.append(f"| {_label(result, system_id)} | {mem.get('status', 'not measured')} | |")
            continue
        lines.append(f"| {_label(result, system_id)} | {mem['peak_rss_bytes'] / MIB:.0f} | "
                     f"{mem['rss_after_load_bytes'] / MIB:.0f} |")
    return lines


def _worker_baseline_ms(result, workload: str) -> str:
    base = result["groups"].get("worker", {}).get("transformers")
    return "–" if base is None else f"{base[workload]['summary']['ttft_s']['median'] * 1e3:.0f} ms"


def _prompt_sizes(result, workload: dict) -> str:
    sizes = [row["prompt_tokens"] for system_id in ran(result) if result["group_of"][system_id] == "main"
             for rows in rows_of(result, system_id, workload["name"])["sequences"].values() for row in rows
             if system_id == "transformers"]
    return f"prompts of {min(sizes)}–{max(sizes)} tokens" if sizes else "prompt sizes not measured"


def _format_note(result) -> str:
    if not result.get("prompt_format", "chat template").startswith("plain"):
        return ""
    return ("A base model without a chat template: every system gets each request as one plain-text "
            "transcript (\"User: ... / Assistant:\") through its completion call (LangChain rows: "
            "`HuggingFacePipeline` and our `KVBoostLLM`; LlamaIndex rows: `complete`), our Engine rows with the "
            "documents as their own segments; replies run to the token limit. ")


def markdown(result, image_dir: str = "benchmarks/results") -> str:
    env, st = result["environment"], result["settings"]
    suffix = _suffix(result)
    title = ("Quick run (`--quick`: smoke-test sizes, 1 repeat, on a shared and noisy machine): not the figures "
             "to quote" if result["mode"] == "quick" else "Full run")
    out = [f"**{title}.** {env['date']}; {env.get('cpu_model', env['cpu'])}, {env['cpu_count']} cores, torch "
           f"threads {env['torch_threads']}; {env['model']}, {env['dtype']} on {env['device']}; torch {env['torch']}, "
           f"transformers {env['transformers']}; load average {env['load_average_start']:.1f} at start, "
           f"{env['load_average_end']:.1f} at end; {st['repeats']} repeat(s) after a warm-up; greedy decoding. "
           f"{_format_note(result)}"
           f"Times are medians over repeats, with the min–max over repeats in brackets; "
           f"\"same reply\" is the share of requests whose text equals plain transformers' reply. "
           f"{_llamacpp_note(result)}"
           f"Whole run: {env['wall_s'] / 60:.0f} min.", ""]
    for workload in result["workloads"]:
        out += [f"#### {workload['title']}: {_prompt_sizes(result, workload)}, at most "
                f"{workload['max_new_tokens']} new tokens", ""]
        out += workload_table(result, workload) + [""]
        if workload["name"] == "rag":
            out += ["Median TTFT (ms) by documents per question:", ""] + rag_by_docs(result, workload) + [""]
    probed = result["settings"].get("memory_workloads", ["chat", "rag", "coding"])
    out += [f"#### Peak memory (each system alone in a fresh process; workloads {', '.join(probed)} once)", ""]
    out += memory_table(result) + [""]
    if any(g == "worker" for s, g in result["group_of"].items() if result["systems"][s]["status"] == "ran"):
        out += ["† ran in its own venv as a worker process of the same run (langchain-huggingface 1.2.3 needs "
                "huggingface-hub<2; ours pins 2.x), same prompts; its speedup is against plain transformers "
                "timed in that process (its median TTFT there: "
                + ", ".join(f"{w['name']} {_worker_baseline_ms(result, w['name'])}" for w in result["workloads"])
                + ").", ""]
    present = {w["name"] for w in result["workloads"]}      # --only runs a subset
    images = [(w, f"![{title}]({image_dir}/{name}{suffix}.png)") for w, title, name in (
        ("chat", "TTFT vs turn", "ttft_vs_turn"), ("chat", "hit rate vs turn", "hit_rate_vs_turn"),
        ("rag", "TTFT vs documents", "ttft_vs_docs"), ("coding", "coding TTFT per request", "coding_ttft"))]
    out += [" ".join(image for w, image in images if w in present)]
    return "\n".join(out) + "\n"


# ---- plots --------------------------------------------------------------------------------------
def _style(system_id: str) -> dict:
    return {"linestyle": "-" if system_id.startswith("ours") else "--", "marker": "o", "markersize": 3}


def plot_all(result, out_dir: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    suffix, paths = _suffix(result), []
    names = ran(result)
    workloads = {w["name"]: w for w in result["workloads"]}

    def save(fig, name):
        for ax in fig.axes:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            if ax.get_ylabel().startswith("TTFT"):
                ax.set_yscale("log")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"{name}{suffix}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)

    if "chat" in workloads:
        plot_chat(result, names, workloads["chat"]["sequences"][0], save)
    if "rag" in workloads:
        plot_rag(result, names, workloads["rag"]["sequences"], save)
    if "coding" in workloads:
        plot_coding(result, names, workloads["coding"]["sequences"][0], save)
    return paths


def plot_chat(result, names, chat, save) -> None:
    import matplotlib.pyplot as plt
    turns = list(range(1, len(chat["requests"]) + 1))
    for name, key, ylabel, scale in (("ttft_vs_turn", "ttft_s", "TTFT (ms, median)", 1e3),
                                     ("hit_rate_vs_turn", "hit_rate", "prompt tokens reused (%)", 100)):
        fig, ax = plt.subplots(figsize=(7, 4))
        for s in names:
            values = series(rows_of(result, s, "chat")["sequences"][chat["key"]], key)
            ax.plot(turns, [v * scale for v in values], label=_label(result, s), **_style(s))
        ax.set(xlabel="turn", ylabel=ylabel, title="Multi-turn chat")
        save(fig, name)


def plot_rag(result, names, rag, save) -> None:
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for s in names:
        seqs = rows_of(result, s, "rag")["sequences"]
        ax.plot([q["x"] for q in rag], [sequence_median(seqs[q["key"]], "ttft_s") * 1e3 for q in rag],
                label=_label(result, s), **_style(s))
    ax.set(xlabel="retrieved documents per question", ylabel="TTFT (ms, median over questions)",
           title="RAG, shuffled documents")
    save(fig, "ttft_vs_docs")


def plot_coding(result, names, coding, save) -> None:
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = list(range(1, len(coding["requests"]) + 1))
    for s in names:
        values = series(rows_of(result, s, "coding")["sequences"][coding["key"]], "ttft_s")
        ax.plot(steps, [v * 1e3 for v in values], label=_label(result, s), **_style(s))
    for step, request in zip(steps, coding["requests"]):
        if request["event"]:
            ax.axvline(step, color="gray", linestyle=":")
            ax.annotate(request["event"], (step, 0.98), xycoords=("data", "axes fraction"), fontsize=7,
                        rotation=90, va="top", ha="right")
    ax.set(xlabel="request", ylabel="TTFT (ms, median)", title="Coding assistant session")
    save(fig, "coding_ttft")


# ---- files --------------------------------------------------------------------------------------
def write_all(result, out_dir: Path) -> Path:
    """JSON, markdown table and PNGs; returns the JSON path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"sidebyside{_suffix(result)}.json"
    path.write_text(json.dumps(result, indent=1))
    (out_dir / f"sidebyside{_suffix(result)}.md").write_text(markdown(result, "."))
    plot_all(result, out_dir)
    return path


def update_readme(result, readme: Path, json_path: Path | None = None) -> None:
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{readme} has no {BEGIN} ... {END} markers")
    source = f"<!-- generated by python -m benchmarks.sidebyside.report from {json_path.relative_to(ROOT) if json_path else 'a run'}; do not edit by hand -->"
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{BEGIN}\n{source}\n\n{markdown(result)}{END}{tail}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "sidebyside.json")
    parser.add_argument("--readme", action="store_true", help="rewrite README.md's results section")
    parser.add_argument("--plots", action="store_true", help="redraw the PNGs and the markdown table too")
    args = parser.parse_args(argv)
    result = json.loads(args.json.read_text())
    if args.plots:
        write_all(result, args.json.parent)
    if args.readme:
        update_readme(result, ROOT / "README.md", args.json.resolve())
    print(markdown(result))


if __name__ == "__main__":
    main()
