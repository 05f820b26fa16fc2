"""Compile and run a C++ harness over native/decode.cpp, once per instruction-set variant, with the
library's own flags (benchmarks.micro.attention_kernels, matrix_kernels).

A harness is C++ source whose `@SOURCE@` is replaced by decode.cpp's path (it #includes it) and whose
program prints one JSON object on stdout."""
from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from kvboost_engine.native import build


def arguments(description: str, argv=None) -> argparse.Namespace:
    """The kernel benchmarks' options: --isa (comma list), --smoke, --out."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--isa", default="", help="comma-separated variants (default: every one this CPU runs)")
    parser.add_argument("--smoke", action="store_true", help="a few iterations, a small cold set")
    parser.add_argument("--out", default=None)
    return parser.parse_args(argv)


def variants(isa_list: str) -> list[str]:
    """The variants named in `isa_list` (comma-separated; empty: every one this CPU runs); SystemExit
    with the reason for one this CPU cannot run."""
    isas = [i for i in isa_list.split(",") if i] or build.candidates()[0]
    for isa in isas:
        reason = build.isa_reason(isa)
        if reason is not None:
            raise SystemExit(f"{isa}: {reason}")
    return isas


def run(name: str, harness: str, isa: str, args: list, workdir: Path) -> dict:
    """Compile `harness` for `isa` with the library's flags (less -shared / -fPIC) as
    workdir/<name>_<isa>, run it with `args`: its JSON."""
    cxx = build.compiler()
    if cxx is None:
        raise SystemExit("no C++ compiler (g++ or $CXX)")
    src = workdir / f"{name}_{isa}.cpp"
    src.write_text(harness.replace("@SOURCE@", str(build.SOURCE)))
    exe = workdir / f"{name}_{isa}"
    flags = [f for f in build.FLAGS if f not in ("-shared", "-fPIC")]
    subprocess.run([cxx, *flags, *build.ISAS[isa][0], "-o", str(exe), str(src)], check=True,
                   capture_output=True, text=True)
    done = subprocess.run([str(exe), *map(str, args)], check=True, capture_output=True, text=True)
    return json.loads(done.stdout)


def run_variants(name: str, harness: str, isas: list[str], args: list, report: Callable[[str, dict], None]) -> dict:
    """`run` for each variant in `isas` (compiled in a temporary folder): {variant: its JSON}, each
    handed to report(variant, JSON) as it comes."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for isa in isas:
            out[isa] = run(name, harness, isa, args, Path(tmp))
            report(isa, out[isa])
    return out
