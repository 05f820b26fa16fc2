"""The kernel benchmarks' tools over native/decode.cpp. The C++ harnesses (benchmarks/micro/matrix_kernels.py,
attention_kernels.py) include it and build its structs and calls by hand: a change of the native
interface (a QMat or Acts field, a kernel's arguments) must not leave them behind (one did: 2026-12-06).
native_ab builds a second copy of it beside the package's and runs both in one process."""
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


def test_native_ab_runs_two_builds_of_the_step_in_one_process(tmp_path, capsys):
    """benchmarks.micro.native_ab builds B from another copy of decode.cpp (build.load_from) and runs
    it beside the package's build over the same rows: a byte-identical copy (the same library) gives
    bit-identical outputs in every case: decode (over one KV, over copies, over pool blocks shared as the
    engine shares a cached prompt's) and prefill."""
    if not build.runs_here():
        pytest.skip(str(build.cpu_reason() or "no C++ compiler"))
    from benchmarks.micro import native_ab
    copy = tmp_path / "decode_copy.cpp"
    copy.write_text(build.SOURCE.read_text())
    native_ab.main(["--against", str(copy), "--smoke"])
    lines = [line for line in capsys.readouterr().out.splitlines() if "B/A" in line]
    assert [line.split()[0] + " " + line.split()[1] for line in lines] == [
        "shared 1", "shared 2", "unshared 1", "unshared 2", "paged 1", "paged 2", "prefill 16"]
    assert all(line.endswith("outputs identical") for line in lines), lines


def test_native_ab_names_a_prefill_the_engine_does_not_run_natively(tmp_path, monkeypatch, capsys):
    """Float32 weights whose prompt chunks the engine runs on PyTorch (decoder.float_prefill_off: Intel's
    MKL, or $KVBOOST_NATIVE_PREFILL=0 as here): the native prefill case is still timed, named as not the
    engine's path, and the reason printed and recorded."""
    if not build.runs_here():
        pytest.skip(str(build.cpu_reason() or "no C++ compiler"))
    from benchmarks.micro import native_ab
    monkeypatch.setenv("KVBOOST_NATIVE_PREFILL", "0")
    copy = tmp_path / "decode_copy.cpp"
    copy.write_text(build.SOURCE.read_text())
    native_ab.main(["--against", str(copy), "--smoke", "--weights", "fp32"])
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.startswith("prefill 16 (not the engine's path here)")]
    assert "the engine's prompt chunks here: KVBOOST_NATIVE_PREFILL=0" in out


def test_a_source_that_does_not_build_or_a_missing_revision_is_reported(tmp_path):
    """load_from gives the compiler's reason for a source that does not build (never raises), and
    refuses a variant this CPU lacks and a missing file; native_ab names an --against that is neither
    a file nor a revision."""
    from benchmarks.micro import native_ab
    if build.compiler() is not None and build.isa_reason("avx2") is None:
        broken = tmp_path / "decode_broken.cpp"
        broken.write_text("int broken = ;\n")
        lib, reason = build.load_from(broken, "avx2")
        assert lib is None and "building decode_broken.cpp (avx2) failed" in reason
    lib, reason = build.load_from(build.SOURCE, "no-such-variant")
    assert lib is None and "is not one of" in reason
    if build.isa_reason("avx2") is None:
        lib, reason = build.load_from(tmp_path / "missing.cpp", "avx2")
        assert lib is None and "no such file" in reason
    with pytest.raises(SystemExit, match="neither a file nor a git revision"):
        native_ab.source_b("no-such-revision-or-file", tmp_path)


def test_native_ab_runs_a_gguf_as_stored(tmp_path, monkeypatch, capsys):
    """--gguf runs both builds over a GGUF file as stored (a tiny random llama in Q4_0, written with the
    gguf package as the GGUF tests write theirs): every case, bit-identical outputs for a copy; a
    missing file is named."""
    if not build.runs_here():
        pytest.skip(str(build.cpu_reason() or "no C++ compiler"))
    from pathlib import Path

    from kvboost_engine.paths import cache_home
    from benchmarks.micro import native_ab
    native_libs = cache_home() / "native"          # the package's build, not built again in the test's home
    native_libs.mkdir(parents=True, exist_ok=True)
    home = tmp_path / "home"
    home.mkdir()
    (home / "native").symlink_to(native_libs, target_is_directory=True)
    monkeypatch.setenv("KVBOOST_HOME", str(home))   # the file's pack goes there
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "tests"))
    from gguf_models import Q, write_model
    path = tmp_path / "tiny.gguf"
    write_model(path, "llama", Q.Q4_0, embed=Q.Q8_0)
    copy = tmp_path / "decode_copy.cpp"
    copy.write_text(build.SOURCE.read_text())
    native_ab.main(["--against", str(copy), "--smoke", "--gguf", str(path)])
    lines = [line for line in capsys.readouterr().out.splitlines() if "B/A" in line]
    assert len(lines) == 7 and all(line.endswith("outputs identical") for line in lines), lines
    with pytest.raises(SystemExit, match="no such file"):
        native_ab.main(["--against", str(copy), "--smoke", "--gguf", str(tmp_path / "missing.gguf")])


def test_matrix_kernels_rounds_range_gives_each_measure_its_least_and_most():
    """matrix_kernels' rounds (the machine's speed round after round) are summed up as [least, most]
    of each measure, the int4 8-row product also against its own round's floor."""
    from benchmarks.micro.matrix_kernels import HARNESS, MACS_M8, rounds_range
    assert "constexpr int ROWS = 576, COLS = 1536;" in HARNESS and MACS_M8 == 576 * 1536 * 8   # one shape
    macs = MACS_M8
    fast = {"macs_per_s": 360e9, "int4_m8_us": 40.0, "int8_m8_us": 38.0, "int4_m1_us": 11.0}
    slow = {"macs_per_s": 270e9, "int4_m8_us": 66.0, "int8_m8_us": 65.0, "int4_m1_us": 12.0}
    got = rounds_range([fast, slow, fast])
    assert got["floor_g"] == [270.0, 360.0]
    assert got["int4_m8_us"] == [40.0, 66.0] and got["int8_m8_us"] == [38.0, 65.0] and got["int4_m1_us"] == [11.0, 12.0]
    assert got["int4_m8_floor_ratio"] == [round(40e-6 * 360e9 / macs, 2), round(66e-6 * 270e9 / macs, 2)]
