"""Side by side: plain transformers, langchain-huggingface, llama-index-llms-huggingface, kvboost 0.9.0
(PyPI) and ours (engine, LangChain, LlamaIndex) on three workloads, one model, one machine.

    python -m benchmarks [--quick] [--readme]       (bash dev.sh bench [--quick] [--readme])
    python -m benchmarks --model gemma3-270m [--quick]     (Gemma 3 270M: completion mode)
    python -m benchmarks --only rag --systems transformers,llamacpp-langchain,ours-engine,ours-engine-int4 \
        --no-memory --out-dir benchmarks/results/rag_cold      (one workload, a few systems)

Workloads (benchmarks.workloads): multi-turn chat replay, RAG with shuffled retrieved documents,
coding assistant with a long system prompt and project files. Every system is built from the
same fp32 model object and tokenizer (SmolLM2-135M-Instruct, CPU), greedy decoding, the same
prompts and max_new_tokens; timing runs in this process with systems interleaved, medians over
repeats, warm-up excluded. All systems share one venv (huggingface-hub 1.33 satisfies both
transformers and langchain-huggingface) and run in this process. Peak RSS: each system alone in a
fresh process.

Writes benchmarks/results/sidebyside[-<model>][-quick].{json,md} and PNG plots; --readme rewrites the
README's results section (python -m benchmarks.sidebyside.report does the same from an existing JSON).
`--model gemma3-270m` runs the same workloads on Gemma 3 270M, a base model without a chat
template: every system gets each request as a plain-text transcript (systems.py says how), and
the replayed chat turns are transformers' greedy continuations up to their first line break.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from . import aggregate, report
from .._common import MODELS, environment, load_model
from .runner import log, probe_memory, run_timing
from .systems import SYSTEMS, Transformers, build, set_attention, version
from .workloads import Workload, chat_workload, coding_workload, rag_workload

ROOT = Path(__file__).resolve().parents[2]      # the repository (this file: benchmarks/sidebyside/)
MAIN_SYSTEMS = ("transformers", "langchain-huggingface", "llama-index-llms-huggingface", "kvboost-pypi",
                "llamacpp-langchain", "llamacpp-llama-index", "ours-engine", "ours-engine-flat",
                "ours-engine-cache-order", "ours-engine-blend", "ours-engine-int4", "ours-langchain", "ours-llama-index")
MODES = {
    "quick": dict(turns=3, chat_tokens=8, doc_counts=(1, 3), rag_questions=3, rag_tokens=8, coding_steps=6,
                  coding_tokens=8, repeats=1, memory_workloads=("chat",)),
    "full": dict(turns=10, chat_tokens=32, doc_counts=(1, 2, 4, 8), rag_questions=8, rag_tokens=12,
                 coding_steps=10, coding_tokens=32, repeats=3, memory_workloads=("chat", "rag", "coding")),
}


def make_workloads(model, tokenizer, settings: dict, names: tuple = ("chat", "rag", "coding")) -> list[Workload]:
    plain = Transformers(model, tokenizer)

    def reply(messages):
        text = plain.answer_text(messages, settings["chat_tokens"])
        return text.split("\n")[0].strip() if plain.completion else text    # a base model runs on past its turn
    makers = {"chat": lambda: chat_workload(settings["turns"], settings["chat_tokens"], reply),
              "rag": lambda: rag_workload(settings["doc_counts"], settings["rag_questions"], settings["rag_tokens"]),
              "coding": lambda: coding_workload(settings["coding_steps"], settings["coding_tokens"])}
    unknown = [n for n in names if n not in makers]
    if unknown:
        raise SystemExit(f"unknown workloads {unknown}: choose from {list(makers)}")
    return [makers[n]() for n in makers if n in names]


def build_systems(ids, model, tokenizer, baseline_attention: str) -> tuple[list, dict]:
    built, status = [], {}
    for system_id in ids:
        try:
            built.append(build(system_id, model, tokenizer, baseline_attention))
            status[system_id] = "ran"
        except Exception as err:  # noqa: BLE001 - reported as a row, never dropped silently
            status[system_id] = f"could not run: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
            log(f"{system_id}: {status[system_id]}")
    return built, status


def load(threads: int, model_name: str = "default"):
    torch.set_num_threads(threads)
    model, tokenizer = load_model(model_name)
    return model, tokenizer, model.config._attn_implementation


# ---- workers (child processes) ------------------------------------------------------------------
def worker(args) -> None:
    model, tokenizer, attention = load(args.threads, args.model)
    workloads = [Workload.from_json(w) for w in json.loads(Path(args.workloads).read_text())]
    if args.worker == "memory":
        systems, status = build_systems([args.system], model, tokenizer, attention)
        out = probe_memory(systems[0], workloads) if systems else {"status": status[args.system]}
    else:
        systems, status = build_systems(args.systems.split(","), model, tokenizer, attention)
        out = {"status": status, "raw": run_timing(systems, workloads, args.repeats),
               "environment": environment(model, args.model), "attention": attention,
               "versions": {s: version(SYSTEMS[s].package) for s in status}}
    Path(args.out).write_text(json.dumps(out))


def run_worker(python: Path, argv: list[str], workdir: Path, tag: str) -> dict:
    out = workdir / f"{tag}.json"
    cmd = [str(python), "-m", "benchmarks.sidebyside.sidebyside", *argv, "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0 or not out.exists():
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"worker {tag} exited {done.returncode}: {tail[-400:]}")
    return json.loads(out.read_text())


# ---- the whole run ------------------------------------------------------------------------------
def run(args) -> dict:
    mode = "quick" if args.quick else "full"
    settings = dict(MODES[mode])
    if args.repeats:
        settings["repeats"] = args.repeats
    wanted = args.systems.split(",") if args.systems else list(MAIN_SYSTEMS)
    started, load_start = time.time(), os.getloadavg()[0]
    model, tokenizer, attention = load(args.threads, args.model)
    workloads = make_workloads(model, tokenizer, settings, tuple(args.only.split(",")) if args.only else ("chat", "rag", "coding"))
    workdir = Path(tempfile.mkdtemp(prefix="kvboost-bench-"))
    spec, memory_spec = workdir / "workloads.json", workdir / "memory-workloads.json"
    spec.write_text(json.dumps([w.to_json() for w in workloads]))
    memory_spec.write_text(json.dumps([w.to_json() for w in workloads if w.name in settings["memory_workloads"]]))
    memory_args = ["--workloads", str(memory_spec), "--threads", str(args.threads), "--model", args.model]

    systems, status = build_systems([s for s in wanted if s in MAIN_SYSTEMS], model, tokenizer, attention)
    groups = {"main": run_timing(systems, workloads, settings["repeats"])}
    set_attention(model, attention)
    processes = {s.id: "this process" for s in systems}
    memory = {}
    if not args.no_memory:
        for system_id in [s for s in wanted if status.get(s) == "ran"]:
            log(f"peak memory: {system_id}")
            try:
                memory[system_id] = run_worker(Path(sys.executable), ["--worker", "memory", "--system", system_id, *memory_args],
                                               workdir, f"memory-{system_id}")
            except RuntimeError as err:
                memory[system_id] = {"status": f"failed: {err}"}
    env = environment(model, args.model)
    env.update(load_average_start=load_start, load_average_end=os.getloadavg()[0], wall_s=time.time() - started,
               baseline_attention=attention)
    return {
        "benchmark": "sidebyside", "mode": mode, "model": args.model,
        "prompt_format": "plain-text transcript (completion)" if not getattr(tokenizer, "chat_template", None)
        else "chat template", "settings": {**settings, "doc_counts": list(settings["doc_counts"]),
                                                   "memory_workloads": list(settings["memory_workloads"])},
        "environment": env, "worker_environment": None,
        "systems": {s: {"label": SYSTEMS[s].label, "package": SYSTEMS[s].package,
                        "version": version(SYSTEMS[s].package), "status": status.get(s, "not requested"),
                        "process": processes.get(s), "memory": memory.get(s)} for s in wanted},
        "workloads": [w.describe() for w in workloads],
        "groups": {name: aggregate.aggregate_group(raw, workloads) for name, raw in groups.items()},
        "group_of": {s: "main" for s in wanted},
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small workloads, 1 repeat: a smoke test (minutes)")
    parser.add_argument("--model", choices=sorted(MODELS), default="default",
                        help="the model by name (gemma3-270m: a base model, completion mode)")
    parser.add_argument("--repeats", type=int, default=0, help="override the mode's repeats")
    parser.add_argument("--systems", default="", help=f"comma-separated subset of {','.join(SYSTEMS)}")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--only", default="", help="comma-separated subset of the workloads chat,rag,coding "
                        "(e.g. --only rag --systems transformers,llamacpp-langchain,ours-engine: the cold RAG TTFT)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-RSS processes")
    parser.add_argument("--readme", action="store_true", help="rewrite README.md's results section from this run")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--worker", choices=["timing", "memory"], help=argparse.SUPPRESS)
    parser.add_argument("--system", help=argparse.SUPPRESS)
    parser.add_argument("--workloads", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    result = run(args)
    path = report.write_all(result, args.out_dir)
    print(report.markdown(result))
    if args.readme and args.model != "default":
        log("--readme is for the default model's run; the results are in " + str(path))
    elif args.readme:
        report.update_readme(result, ROOT / "README.md", path)
        log("README.md results section rewritten")


if __name__ == "__main__":
    main()
