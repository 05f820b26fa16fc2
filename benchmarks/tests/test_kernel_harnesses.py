"""The kernel benchmarks' C++ harnesses (benchmarks/micro/matrix_kernels.py, attention_kernels.py) include
native/decode.cpp and build its structs and calls by hand: a change of the native interface (a QMat or
Acts field, a kernel's arguments) must not leave them behind (one did: 2026-12-06)."""
from __future__ import annotations

import platform
import subprocess

import pytest

from kvboost_engine.native import build


@pytest.mark.parametrize("module", ["matrix_kernels", "attention_kernels"])
def test_kernel_harness_compiles_against_the_native_source(module, tmp_path):
    import importlib
    harness = importlib.import_module(f"benchmarks.micro.{module}").HARNESS
    cxx = build.compiler()
    if cxx is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("no C++ compiler" if cxx is None else "the harnesses are x86-64 code")
    source = tmp_path / f"{module}.cpp"
    source.write_text(harness.replace("@SOURCE@", str(build.SOURCE)))
    flags = [f for f in build.FLAGS if f not in ("-shared", "-fPIC", "-O3")]
    done = subprocess.run([cxx, "-fsyntax-only", *flags, *build.ISAS["avx2"][0], str(source)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
