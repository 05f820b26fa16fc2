"""Shared benchmark plumbing: the default model, and a record of the machine and settings."""
from __future__ import annotations

import datetime
import json
import os
import statistics
import time
import platform
from pathlib import Path

import torch

from kvboost_engine.loading import default_model_dir, load_model_and_tokenizer, resolve_model_dir

# --model choices of the benchmarks that run on more than the default model, and how results name them
MODELS = {
    "default": "SmolLM2-135M-Instruct (GGUF Q4_1 dequantized)",
    "gemma3-270m": "Gemma 3 270M base (GGUF Q4_K_M dequantized)",
}


def bench_device() -> torch.device:
    """Where benchmarks put the model: $KVBOOST_BENCH_DEVICE ("cpu" by default; "cuda" on a GPU machine)."""
    return torch.device(os.environ.get("KVBOOST_BENCH_DEVICE") or "cpu")


def load_default(dtype=torch.float32):
    source = default_model_dir()
    model, tokenizer = load_model_and_tokenizer(source, device=bench_device(), dtype=dtype)
    model.bench_source = source             # where a second copy (another weights= format) loads from
    return model, tokenizer


def load_model(name: str = "default", dtype=torch.float32):
    """(model, tokenizer) of a `MODELS` entry, fp32 on `bench_device()` (a named model is fetched and
    converted once)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    if name == "default":
        return load_default(dtype)
    source = resolve_model_dir(name)
    model, tokenizer = load_model_and_tokenizer(source, device=bench_device(), dtype=dtype)
    model.bench_source = source
    return model, tokenizer


def environment(model, name: str = "default") -> dict:
    """What a reader needs to reproduce a figure: model, dtype, threads, machine, versions, date."""
    import transformers
    param = next(model.parameters())
    return {
        "model": MODELS.get(name, name),
        "dtype": str(param.dtype), "device": str(param.device),
        "gpu": torch.cuda.get_device_name(param.device) if param.device.type == "cuda" else None,
        "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "date": datetime.date.today().isoformat(),
        "load_average": os.getloadavg()[0], "cpu_model": cpu_model(),
        # spinning OpenMP threads slow 2-thread runs 10-100x on a busy machine: PASSIVE for timings
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset"),
    }


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def drop_page_cache(path) -> None:
    """Ask the kernel to forget a file's cached pages (for cold-read measurements; Linux)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def chat_with_first_logits(engine, messages, **params):
    """`engine.chat`, plus the logits [vocab] its first token was chosen from (via instrumentation)."""
    return with_first_logits(engine, lambda: engine.chat(messages, **params))


def with_first_logits(engine, request):
    """`request()` (a call on `engine`), plus the logits [vocab] its first token was chosen from."""
    from kvboost_engine import FirstTokenEvent
    seen = []
    with engine.instruments.subscribe(lambda e: seen.append(e.logits) if isinstance(e, FirstTokenEvent) else None):
        gen = request()
    return gen, seen[-1].float().cpu()


def median_time(fn, repeats: int) -> float:
    """Median seconds of `fn()` over `repeats` runs, after one warm-up run (excluded)."""
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def save_result(result: dict, out: str | None, stem: str, model: str = "default") -> Path:
    """Write a benchmark's result as JSON to `out`, or to benchmarks/results/<stem>[_<model>].json."""
    suffix = "" if model == "default" else f"_{model}"
    path = Path(out or f"benchmarks/results/{stem}{suffix}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    return path
