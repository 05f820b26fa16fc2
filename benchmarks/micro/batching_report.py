"""Parts of benchmarks/micro/batching.py: the weights it loads besides fp32, the bounds of a step of
8 rows, llama.cpp's llama-batched-bench on the same model, and the summary table."""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from .._common import bench_device
from ..gguf_models import model_file, tools_dir
from .gguf import _timed

LLAMA_SIZE = ["-c", "4096", "-b", "512", "-ub", "512", "-npp", "400", "-ntg", "48"]
LLAMA_SMOKE = ["-c", "512", "-b", "64", "-ub", "64", "-npp", "16", "-ntg", "4"]


def load_weights(name: str, gguf: str | None):
    """(model, tokenizer) of the default model with weights="int4", or of the GGUF file as stored."""
    from kvboost_engine import Engine
    source, weights = (gguf, None) if name == "gguf" else (None, name)
    engine = Engine.from_pretrained(source, weights=weights, device=bench_device(), cache_bytes=0)
    model, tokenizer = engine.model, engine.tokenizer
    engine.close()                  # the benchmark's engines are built over the model
    return model, tokenizer


def weight_read_s(model) -> float:
    """Seconds to stream every weight once from memory (the floor of one decode step). Float32
    tensors are summed where they are; the bytes of the others (packed int4/GGUF codes and scales,
    which are buffers) are read as a float32 scratch tensor of the same size: a sum over uint8
    codes runs far below the read rate (measured 0.3 GB/s against ~8 GB/s here)."""
    tensors = [p for p in model.parameters()] + [b for b in model.buffers() if b.numel() > 1024]
    floats = [t for t in tensors if t.dtype == torch.float32]
    other_bytes = sum(t.numel() * t.element_size() for t in tensors if t.dtype != torch.float32)
    if other_bytes:
        floats.append(torch.ones(other_bytes // 4))
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for p in floats:
            p.sum()
        best = min(best, time.perf_counter() - start)
    return best


def linear_s(model, rows: int) -> float:
    """Seconds for every Linear layer of the model (lm_head included) on `rows` random input rows:
    the weight products of one decode step of `rows` sequences."""
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {m.in_features: torch.randn(rows, m.in_features, dtype=m.weight.dtype, device=m.weight.device)
              for m in layers}
    best = float("inf")
    with torch.inference_mode():
        for _ in range(3):
            start = time.perf_counter()
            for m in layers:
                m(inputs[m.in_features])
            best = min(best, time.perf_counter() - start)
    return best


def step_read_bytes(model) -> int:
    """Bytes of weights one decode step reads: every parameter and large buffer, less the stored m of
    packed matrices whose m the native step derives from d (zero_code; a GGUF's Q4_0 / Q8_0 matrices
    store none)."""
    from kvboost_engine.weights.packed import PackedLinear
    tensors = [p for p in model.parameters()] + [b for b in model.buffers() if b.numel() > 1024]
    total = sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())
    skipped = {id(m.m): m.m for m in model.modules() if isinstance(m, PackedLinear) and m.zero_code and m.m is not None}
    return total - sum(t.numel() * t.element_size() for t in skipped.values())


def kv_bytes_per_token(engine) -> int:
    """Bytes of K and V one token of context holds, every layer (the engine's KV dtype)."""
    return engine.adapter.geometry.bytes_per_token


def unshared_bound(weight_bytes: int, kv_bytes: int, rows: int = 8) -> float:
    """Speed-up at `rows` sequences with nothing shared if a step cost only its memory reads: one pass
    over the weights plus each sequence's own KV, against one sequence's step (weights + its KV)."""
    return round(rows * (weight_bytes + kv_bytes) / (weight_bytes + rows * kv_bytes), 2)


def llama_sizes(prompt: int | None) -> list[str]:
    """llama-batched-bench's sizes: LLAMA_SIZE, or a prompt of `prompt` tokens (its context then room for
    8 sequences of it and their 48 new tokens each, unshared)."""
    if prompt is None:
        return LLAMA_SIZE
    return ["-c", str(8 * (prompt + 48)), "-b", "512", "-ub", "512", "-npp", str(prompt), "-ntg", "48"]


def llama_batched(gguf: str | None, threads: int, smoke: bool = False, prompt: int | None = None) -> dict:
    """llama-batched-bench at 1 and 8 sequences, the prompt shared (-pps) and not; `prompt`: its length
    in tokens (default LLAMA_SIZE's 400)."""
    path = Path(gguf) if gguf else model_file("default", "q4_0")
    out: dict = {"file": str(path)}
    for key, extra in (("shared", ["-pps"]), ("unshared", [])):
        cmd = [str(tools_dir() / "bin" / "llama-batched-bench"), "-m", str(path), *(LLAMA_SMOKE if smoke else llama_sizes(prompt)),
               "-npl", "1,8", "-t", str(threads), "--output-format", "jsonl", *extra]
        try:
            text, _, seconds, _ = _timed(cmd)
        except RuntimeError as error:
            out[key] = {"status": str(error)}
            continue
        rows = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
        out[key] = {"command": " ".join(cmd[1:]), "seconds": round(seconds, 1),
                    "rows": [{k: r[k] for k in ("pl", "pp", "tg", "speed_pp", "speed_tg", "speed", "t_pp", "t_tg")}
                             for r in rows]}
        print(key, out[key]["rows"], flush=True)
    return out


def _llama_tg(result: dict, key: str, pl: int) -> float | None:
    rows = result.get("llama", {}).get(key, {}).get("rows", [])
    return next((r["speed_tg"] for r in rows if r["pl"] == pl), None)


def _llama_prompt(result: dict) -> str:
    """llama-batched-bench's prompt in this run (its rows' pp), or that it did not run."""
    rows = result.get("llama", {}).get("shared", {}).get("rows", [])
    return f"its prompt {rows[0]['pp']} tokens, 48 new" if rows else "not run in this run"


def summary(result: dict) -> dict:
    """The acceptance figures of #29 from a run's sections."""
    out: dict = {"weights": {}}
    llama_8 = _llama_tg(result, "shared", 8)
    for name in result.get("weights", []):
        sections, row = result.get(name, {}), {}
        if "levels" in sections:
            lv = sections["levels"]
            at_8 = next(r for r in lv["rows"] if r["concurrent"] == 8)
            row.update({"serial_tok_s": lv["serial_tok_s"], "shared_speedup_at_8": lv["paired_at_8"]["median_speedup"],
                        "shared_decode_speedup_at_8": lv["paired_at_8"]["median_decode_speedup"],
                        "tok_s_at_8": at_8["tok_s"], "decode_tok_s_at_8": at_8["decode_tok_s"],
                        "greedy_same_as_serial": all(r["greedy_same_as_serial"] for r in lv["rows"])
                        and lv["paired_at_8"]["greedy_same_as_serial"],
                        "bound_at_8": lv["bound_at_8"], "bound_at_8_linear": lv.get("bound_at_8_linear"),
                        "step_speedup_at_8": lv["step_speedup_at_8"]})
            if llama_8:
                row["decode_at_8_vs_llama"] = round(at_8["decode_tok_s"] / llama_8, 2)
        if "unshared" in sections:
            un = sections["unshared"]
            row.update({"unshared_speedup_at_8": un["median_speedup"],
                        "unshared_decode_speedup_at_8": un["median_decode_speedup"],
                        "unshared_greedy_same_as_serial": un["greedy_same_as_serial"],
                        "unshared_read_bound_at_8": un.get("read_bound_at_8")})
        out["weights"][name] = row
    out["llama_tg_tok_s"] = {f"{key}@{pl}": _llama_tg(result, key, pl) for key in ("shared", "unshared") for pl in (1, 8)}
    out["note"] = ("speedup: wall tokens/s of 8 at once over serial (paired, median); decode speed-up: sequences / "
                   "mean gap between tokens; decode_at_8_vs_llama: our decode tok/s at 8 over llama-batched-bench's "
                   f"speed_tg at -npl 8 with -pps ({_llama_prompt(result)}; ours a "
                   f"system prompt of {result.get('system_tokens', 1000)} tokens + a question, 64 new)")
    return out


def summary_table(s: dict) -> str:
    cols = ["serial_tok_s", "shared_speedup_at_8", "shared_decode_speedup_at_8", "unshared_speedup_at_8",
            "unshared_decode_speedup_at_8", "tok_s_at_8", "decode_tok_s_at_8", "decode_at_8_vs_llama",
            "greedy_same_as_serial", "unshared_greedy_same_as_serial", "step_speedup_at_8", "bound_at_8",
            "bound_at_8_linear", "unshared_read_bound_at_8"]
    lines = ["| weights | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, row in s["weights"].items():
        lines.append(f"| {name} | " + " | ".join(str(row.get(c, "-")) for c in cols) + " |")
    llama = ", ".join(f"{k} {v:.1f}" if v else f"{k} -" for k, v in s["llama_tg_tok_s"].items())
    return "\n".join(lines + [f"llama-batched-bench speed_tg tok/s: {llama}"])
