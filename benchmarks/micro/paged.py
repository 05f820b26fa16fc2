"""Paged KV: decode speed and jitter, memory under a budget, restart from disk, block sharing.

Sections (each in a fresh subprocess where memory or restarts matter):
  decode   tokens/s of paged vs contiguous KV at 1k, 4k and 7.5k context (fresh prompt, and a
           prompt whose first half is mapped from the cache: more than one run of blocks);
           p50/p99 per-token decode time at 7.5k
  memory   a prompt at the full 8k window under a pool budget smaller than its KV: refused
           without the disk tier, runs with it; peak RSS against the contiguous run
  restart  a 2k-token system prompt: TTFT cold vs in a second process with the same disk dir
  sharing  N concurrent chats over one 2k-token system prompt: pool blocks in use
  int8     chunks restored from int8 disk entries vs float ones: first-token KL, same greedy reply

Run: python -m benchmarks.micro.paged [--sections decode,memory,restart,sharing] [--out benchmarks/results/paged.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from kvboost_engine import Engine, ForwardEvent

from .._common import chat_with_first_logits, environment, load_default

ROOT = Path(__file__).resolve().parents[2]      # the repository (this file: benchmarks/micro/)
PER_TOKEN = 46080               # SmolLM2-135M fp32: 30 layers x 2 x 3 heads x 64 dims x 4 bytes


def long_text(tokens_wanted: int, tokenizer) -> str:
    sentence = "Record {i}: the sensor in hall {h} measured {v} units at noon. "
    text, i = "", 0
    while len(tokenizer(text)["input_ids"]) < tokens_wanted:
        text += "".join(sentence.format(i=j, h=j % 13, v=(j * 37) % 101) for j in range(i, i + 50))
        i += 50
    ids = tokenizer(text)["input_ids"][:tokens_wanted]
    return tokenizer.decode(ids)


def decode_run(engine: Engine, prompt: str, new_tokens: int) -> dict:
    steps = []

    def on_event(event) -> None:
        if isinstance(event, ForwardEvent) and event.kind == "decode":
            steps.append(event.seconds)

    with engine.instruments.subscribe(on_event):
        g = engine.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    return {"tok_s": (new_tokens - 1) / (g.total_s - g.ttft_s), "steps": steps, "token_ids": g.token_ids}


def section_decode(new_tokens: int = 64, repeats: int = 3) -> dict:
    model, tokenizer = load_default()
    rows = []
    for context in (1000, 4000, 7500):
        prompt = long_text(context, tokenizer)
        paged = Engine(model, tokenizer, paged=True, cache_bytes=0)
        contiguous = Engine(model, tokenizer, paged=False, cache_bytes=0)
        shared = Engine(model, tokenizer, paged=True)
        shared.warm(prompt[:len(prompt) // 2])
        runs = {"paged": [], "contiguous": [], "paged_shared_prefix": []}
        for _ in range(repeats):
            for name, engine in (("paged", paged), ("contiguous", contiguous), ("paged_shared_prefix", shared)):
                runs[name].append(decode_run(engine, prompt, new_tokens))
        row = {"context": context, **{f"{k}_tok_s": statistics.median(r["tok_s"] for r in v) for k, v in runs.items()}}
        row["paged_over_contiguous"] = row["paged_tok_s"] / row["contiguous_tok_s"]
        row["shared_over_contiguous"] = row["paged_shared_prefix_tok_s"] / row["contiguous_tok_s"]
        row["identical_tokens"] = runs["paged"][0]["token_ids"] == runs["contiguous"][0]["token_ids"] \
            == runs["paged_shared_prefix"][0]["token_ids"]
        for name in ("paged", "contiguous"):
            steps = sorted(s for r in runs[name] for s in r["steps"])
            row[f"{name}_p50_ms"] = 1e3 * steps[len(steps) // 2]
            row[f"{name}_p99_ms"] = 1e3 * steps[min(len(steps) - 1, int(0.99 * len(steps)))]
        print(json.dumps(row), flush=True)
        rows.append(row)
    return {"rows": rows}


MEMORY_CHILD = """
import json, resource, sys, torch
from kvboost_engine import BudgetError, Engine
from kvboost_engine.loading import default_model_dir, load_model_and_tokenizer
from benchmarks.micro.paged import long_text
mode, directory = sys.argv[1], sys.argv[2]
model, tokenizer = load_model_and_tokenizer(default_model_dir(), device=torch.device("cpu"), dtype=torch.float32)
prompt = long_text(8000, tokenizer)
options = {"contiguous": dict(paged=False, cache_bytes=0),
           "paged_no_disk": dict(cache_bytes=0, kv_pool_bytes=128 * 2**20),
           "paged_disk": dict(cache_bytes=0, kv_pool_bytes=128 * 2**20, disk_cache_dir=directory)}[mode]
engine = Engine(model, tokenizer, **options)
def status():
    return dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
before = status()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")                    # reset the peak (VmHWM): measure the request, not the model load
try:
    g = engine.generate(prompt, max_new_tokens=64, min_new_tokens=64)
    result = {"ran": True, "prompt_tokens": g.prompt_tokens, "token_ids": g.token_ids, "ttft_s": g.ttft_s}
except BudgetError as err:
    result = {"ran": False, "error": str(err)}
after = status()
result["peak_rss_mb_process"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # includes loading
result["rss_mb_before_request"] = int(before["VmRSS"].split()[0]) / 1024
result["peak_rss_mb_during_request"] = int(after["VmHWM"].split()[0]) / 1024
result["peak_rss_mb_request_over_before"] = result["peak_rss_mb_during_request"] - result["rss_mb_before_request"]
result["rss_anon_mb_at_end"] = int(after["RssAnon"].split()[0]) / 1024
result["rss_file_mb_at_end"] = int(after["RssFile"].split()[0]) / 1024
result["kv_bytes_needed"] = (8000 + 64) * 46080
print(json.dumps(result))
"""


def child(script: str, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, cwd=ROOT, env=env)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def section_memory() -> dict:
    with tempfile.TemporaryDirectory() as directory:
        results = {mode: child(MEMORY_CHILD, mode, directory) for mode in ("contiguous", "paged_no_disk", "paged_disk")}
    same = results["paged_disk"].get("token_ids") == results["contiguous"].get("token_ids")
    for r in results.values():
        r.pop("token_ids", None)
    print(json.dumps(results), flush=True)
    return {**results, "pool_budget_mb": 128, "identical_tokens": same}


RESTART_CHILD = """
import json, sys, torch
from kvboost_engine import Engine
from kvboost_engine.loading import default_model_dir, load_model_and_tokenizer
from benchmarks.micro.paged import long_text
directory = sys.argv[1]
model, tokenizer = load_model_and_tokenizer(default_model_dir(), device=torch.device("cpu"), dtype=torch.float32)
system = long_text(2000, tokenizer)
engine = Engine(model, tokenizer, disk_cache_dir=directory) if directory != "-" else Engine(model, tokenizer)
g = engine.chat([{"role": "system", "content": system}, {"role": "user", "content": "Which hall is record 7 in?"}],
                max_new_tokens=8)
engine.close()
print(json.dumps({"ttft_s": g.ttft_s, "reused": g.reused_tokens, "prompt": g.prompt_tokens, "ids": g.token_ids}))
"""


def section_restart(repeats: int = 3) -> dict:
    cold, warm = [], []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as directory:
            cold.append(child(RESTART_CHILD, directory))
            warm.append(child(RESTART_CHILD, directory))
    result = {"cold_ttft_s": statistics.median(r["ttft_s"] for r in cold),
              "second_process_ttft_s": statistics.median(r["ttft_s"] for r in warm),
              "prompt_tokens": cold[0]["prompt"], "second_process_reused": warm[0]["reused"],
              "identical_tokens": all(c["ids"] == w["ids"] for c, w in zip(cold, warm))}
    result["speedup"] = result["cold_ttft_s"] / result["second_process_ttft_s"]
    print(json.dumps(result), flush=True)
    return result


def section_sharing(chats: int = 8) -> dict:
    model, tokenizer = load_default()
    engine = Engine(model, tokenizer)
    system = [{"role": "system", "content": long_text(2000, tokenizer)}]
    engine.warm(system)
    prompt_blocks = engine.stats()["pool_blocks_used"]
    streams = [engine.stream_chat(system + [{"role": "user", "content": f"Question {i}: which hall?"}],
                                  max_new_tokens=16) for i in range(chats)]
    for stream in streams:
        next(stream)
    used = engine.stats()["pool_blocks_used"]
    for stream in streams:
        stream.collect()
    result = {"chats": chats, "system_prompt_blocks": prompt_blocks, "pool_blocks_used_during": used,
              "without_sharing_would_be": prompt_blocks * (chats + 1), "block_tokens": 16}
    print(json.dumps(result), flush=True)
    return result


INT8_PROMPTS = ["Summarise the records of hall {h}.", "Which record in hall {h} has the largest value?",
                "List two records from hall {h}.", "What is measured in hall {h}?"]


def section_int8(prompts: int = 12, new_tokens: int = 16) -> dict:
    """Quality of chunks restored from int8 disk entries vs float ones (same prompts, same model)."""
    import torch
    model, tokenizer = load_default()
    rows = []
    with tempfile.TemporaryDirectory() as f32_dir, tempfile.TemporaryDirectory() as int8_dir:
        for i in range(prompts):
            system = long_text(400 + 50 * i, tokenizer)
            messages = [{"role": "system", "content": system},
                        {"role": "user", "content": INT8_PROMPTS[i % 4].format(h=i % 13)}]
            for directory, int8 in ((f32_dir, False), (int8_dir, True)):
                with Engine(model, tokenizer, disk_cache_dir=directory, disk_kv_int8=int8) as writer:
                    writer.warm(messages[:1])
            outs = {}
            for directory, int8 in ((f32_dir, False), (int8_dir, True)):
                with Engine(model, tokenizer, disk_cache_dir=directory, disk_kv_int8=int8) as reader:
                    outs[int8] = chat_with_first_logits(reader, messages, max_new_tokens=new_tokens)
            p = torch.log_softmax(outs[False][1].double(), -1)
            q = torch.log_softmax(outs[True][1].double(), -1)
            rows.append({"kl_first_token": float((p.exp() * (p - q)).sum()),
                         "same_reply": outs[False][0].token_ids == outs[True][0].token_ids,
                         "restored_tokens": outs[True][0].reused_tokens})
            sizes = [sum(f.stat().st_size for f in Path(d).rglob("*.kv")) for d in (f32_dir, int8_dir)]
    result = {"prompts": prompts, "mean_kl_first_token": statistics.mean(r["kl_first_token"] for r in rows),
              "same_greedy_reply_share": statistics.mean(r["same_reply"] for r in rows),
              "disk_bytes_ratio_int8_over_fp32": sizes[1] / sizes[0]}
    print(json.dumps(result), flush=True)
    return result


SECTIONS = {"decode": section_decode, "memory": section_memory, "restart": section_restart, "sharing": section_sharing,
            "int8": section_int8}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--out", default="benchmarks/results/paged.json")
    args = parser.parse_args(argv)
    model, _ = load_default()
    result = {"benchmark": "paged", "environment": environment(model)}
    for name in args.sections.split(","):
        result[name] = SECTIONS[name]()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
