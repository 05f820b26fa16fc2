"""Build decode.cpp once per source, compiler, instruction set and machine kind; load it with ctypes.

The library is compiled with the system C++ compiler (`$CXX`, else g++, else c++) into
`$KVBOOST_HOME/native/`, under a name keyed by the source, the compiler and the flags, so a later
process loads it without compiling. One library per instruction-set variant (ISAS, best first):
AVX512 with VNNI, AVX2 with AVX-VNNI, plain AVX2 (each with FMA and F16C), named instruction sets,
never `-march=native` (some VMs advertise extensions they cannot run). The best variant the CPU
reports runs; `KVBOOST_NATIVE_ISA=avx512|avxvnni|avx2` (or `load(isa=...)`) forces one, refused
with a reason where the CPU lacks it (`load_from(source, isa)` builds another copy of the source
the same way, for benchmarks comparing two versions in one process). Anything missing (not x86-64
Linux, a CPU without AVX2, FMA and F16C, no compiler, a failed build, a compile past
$KVBOOST_NATIVE_BUILD_TIMEOUT_S, stopped with its children) is reported as a reason, never raised:
callers fall back to the PyTorch path.

It is built with OpenMP: its `libgomp.so.1` is, by soname, the one PyTorch's Linux wheels ship and
have already loaded, so a step runs on the calling thread's own OpenMP team, the threads its
PyTorch ops use (a second runtime's threads would compete with them for the cores).

Every version of the source leaves a library of its own (each upgrade, each benchmark's copy): a new
build removes the libraries beside it that no process has loaded for STALE_DAYS (a load marks its
library used) with their lock files, and staging files a killed build left. A process that found a
library and then lost it to such a prune before opening it (or found it damaged) builds it again.
"""
from __future__ import annotations

import ctypes
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import xxhash

from ..paths import build_lock, cache_home
from . import abi
from .library_files import STALE_DAYS  # noqa: F401 - the library files' rules, named here too
from .library_files import DAMAGED, PREFIX, drop_refused as _drop, inode as _inode, intact as _intact, \
    mark_used as _mark_used, prune

SOURCE = Path(__file__).with_name("decode.cpp")
ABI_VERSION = 16
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-pthread", "-fopenmp")
# variant: (compiler flags, /proc/cpuinfo flags it needs), best first
ISAS = {
    "avx512": (("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mfma", "-mf16c",
                "-DKVB_ISA_AVX512"),
               ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "fma", "f16c")),
    "avxvnni": (("-mavx2", "-mfma", "-mf16c", "-mavxvnni", "-DKVB_ISA_AVXVNNI"), ("avx2", "fma", "f16c", "avx_vnni")),
    "avx2": (("-mavx2", "-mfma", "-mf16c", "-DKVB_ISA_AVX2"), ("avx2", "fma", "f16c")),
}
ENV = "KVBOOST_NATIVE_ISA"
BUILD_TIMEOUT_ENV, BUILD_TIMEOUT_S = "KVBOOST_NATIVE_BUILD_TIMEOUT_S", 300     # one variant's compile, at most
log = logging.getLogger(__name__)
_loaded: dict = {}
_lock = threading.Lock()


def _cpuinfo(field: str) -> str:
    """The first value of `field` in /proc/cpuinfo ("" where absent); OSError where unreadable."""
    with open("/proc/cpuinfo") as info:
        return next((line.split(":", 1)[1].strip() for line in info if line.startswith(field)), "")


def cpu_flags() -> tuple[set[str] | None, str | None]:
    """(this CPU's flags, None), or (None, why they do not matter: not x86-64 Linux, unreadable)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None, f"native decode needs x86-64 Linux (this is {platform.system()} {platform.machine()})"
    try:
        return set(_cpuinfo("flags").split()), None
    except OSError as err:
        return None, f"cannot read /proc/cpuinfo ({err})"


def cpu_vendor() -> str | None:
    """/proc/cpuinfo's vendor_id (GenuineIntel, AuthenticAMD), or None where it cannot be read."""
    try:
        return _cpuinfo("vendor_id") or None
    except OSError:
        return None


def isa_reason(isa: str) -> str | None:
    """Why this machine cannot run variant `isa` (None: it can)."""
    if isa not in ISAS:
        return f"{ENV}={isa!r} is not one of {', '.join(ISAS)}"
    flags, reason = cpu_flags()
    if flags is None:
        return reason
    missing = [flag for flag in ISAS[isa][1] if flag not in flags]
    return f"the CPU lacks {', '.join(missing)}" if missing else None


def candidates(isa: str | None = None) -> tuple[list[str], str | None]:
    """(the variants to try, best first, for `isa` or $KVBOOST_NATIVE_ISA or else every one this CPU
    runs; None) or ([], why none can run)."""
    isa = isa or os.environ.get(ENV) or None
    if isa is not None:
        reason = isa_reason(isa)
        if reason is None:
            return [isa], None
        return [], reason if isa not in ISAS else f"the {isa} variant was asked for, but {reason}"
    usable = [name for name in ISAS if isa_reason(name) is None]
    return (usable, None) if usable else ([], isa_reason("avx2"))


def cpu_reason() -> str | None:
    """Why this machine cannot run the native step (None: it can, in some variant)."""
    return candidates()[1]


def compiler() -> str | None:
    """The C++ compiler: $CXX (a command line: its first word resolved on PATH, its other words passed
    on, as `CXX="ccache g++"`), else g++, else c++; None where $CXX is set and cannot be found, or
    none exists."""
    cxx = os.environ.get("CXX", "").strip()
    if cxx:
        if shutil.which(cxx):                  # a whole path, spaces and all (conda's)
            return shlex.quote(shutil.which(cxx))
        try:
            words = shlex.split(cxx)
        except ValueError:
            return None
        found = shutil.which(words[0]) if words else None
        return shlex.join([found, *words[1:]]) if found else None
    found = shutil.which("g++") or shutil.which("c++")
    return shlex.quote(found) if found else None


def runs_here() -> bool:
    """Whether this machine can run the native step at all: a CPU variant and a C++ compiler."""
    return cpu_reason() is None and compiler() is not None


def library_path(cxx: str, isa: str, source: Path = SOURCE) -> Path:
    """The library's path in the cache, keyed by the source, the compiler (its command and the first
    line of its --version), the flags and the variant. OSError / SubprocessError where the compiler
    cannot be run (or hangs: 60 s)."""
    version = subprocess.run([*shlex.split(cxx), "--version"], capture_output=True, text=True, errors="replace",
                             timeout=60).stdout.splitlines()[:1]
    key = xxhash.xxh3_64_hexdigest("\0".join([source.read_text(), cxx, *version, *FLAGS, *ISAS[isa][0]]).encode())
    return cache_home() / "native" / f"{PREFIX}{isa}-{key}.so"


def load(isa: str | None = None) -> tuple[object | None, str | None]:
    """(the loaded library, None), or (None, why not): variant `isa`, else $KVBOOST_NATIVE_ISA's, else
    the best this CPU runs (the next one where a build fails). Builds it on first use; cached per
    process. `lib.isa` names the variant."""
    with _lock:
        want = isa or os.environ.get(ENV) or None
        if want in _loaded:
            return _loaded[want]
        names, reason = candidates(want)
        lib, failures = None, []
        for name in names:
            lib, reason = _build_and_open(name)
            if lib is not None:
                break
            failures.append(reason)
        if lib is None:
            reason = "; ".join(failures) or reason
            log.info("kvboost native decode off: %s", reason)
        _loaded[want] = lib, (None if lib is not None else reason)
        return _loaded[want]


def load_from(source: Path, isa: str) -> tuple[object | None, str | None]:
    """(variant `isa` built from another copy of decode.cpp at `source`, None), or (None, why not):
    for comparing two versions of the kernels in one process (benchmarks.micro.native_ab). Built and
    cached as `load` builds the package's own source (keyed by its text); not kept per process, and
    refused, as `load` refuses it, where this CPU lacks the variant."""
    reason = isa_reason(isa)
    if reason is not None:
        return None, reason
    if not Path(source).is_file():
        return None, f"{source}: no such file"
    return _build_and_open(isa, Path(source))


def _build_and_open(isa: str, source: Path = SOURCE) -> tuple[object | None, str | None]:
    cxx = compiler()
    if cxx is None:
        if os.environ.get("CXX", "").strip():
            return None, f"the C++ compiler $CXX={os.environ['CXX']!r} was not found"
        return None, "no C++ compiler found (set CXX, or install g++)"
    try:
        path = library_path(cxx, isa, source)
    except (OSError, subprocess.SubprocessError) as err:
        return None, f"running the C++ compiler {cxx!r} failed: {err}"
    for attempt in range(2):
        try:
            if not _intact(path):
                with build_lock(path):
                    if not _intact(path):           # absent, or cut short (a crash mid-write, a partial copy):
                        path.unlink(missing_ok=True)   # mapped, it would kill the process (SIGBUS)
                        _compile(cxx, path, isa, source)
                        prune(path)
            _mark_used(path)
        except (OSError, subprocess.SubprocessError, RuntimeError) as err:
            return None, f"building {source.name} ({isa}) failed: {err}"
        try:
            opened = _inode(path)
            lib = ctypes.CDLL(str(path))
            break
        except OSError as err:      # pruned by another process between the check and the load, or damaged:
            if attempt == 0 and (not path.exists() or any(m in str(err) for m in DAMAGED) and _drop(path, opened)):
                continue            # built again
            return None, f"loading {path.name} ({isa}) failed: {err}"
    if lib.kvb_abi_version() != ABI_VERSION:
        return None, f"{path} has ABI {lib.kvb_abi_version()}, expected {ABI_VERSION}"
    _declare(lib)
    structs = (abi.MatArgs, abi.LayerArgs, abi.ModelArgs, abi.Row)
    if [lib.kvb_struct_size(i) for i in range(4)] != [ctypes.sizeof(s) for s in structs]:
        return None, f"{path}: the C structures' sizes differ from native/abi.py's"
    lib.isa = lib.kvb_isa().decode()
    if lib.isa != isa:
        return None, f"{path} was built for {lib.isa}, not {isa}"
    return lib, None


def _compile(cxx: str, path: Path, isa: str, source: Path = SOURCE) -> None:
    handle, staging = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=path.parent)
    os.close(handle)
    try:
        returncode, stderr = _run_compiler([*shlex.split(cxx), *FLAGS, *ISAS[isa][0], str(source), "-o", staging])
        if returncode != 0:
            raise RuntimeError(" | ".join(stderr.strip().splitlines()[-3:])[-500:])
        os.chmod(staging, 0o755)           # not mkstemp's 0600 (kept by the linker): others sharing the cache load it
        with open(staging, "rb") as f:     # on disk before it takes the name: a crash after the rename must not
            os.fsync(f.fileno())           # leave a short file there (a lost rename only means a rebuild)
        os.replace(staging, path)
    finally:
        if os.path.exists(staging):
            os.remove(staging)


def _run_compiler(cmd: list[str]) -> tuple[int, str]:
    """(exit status, stderr) of the compiler, run in a process group of its own: past
    $KVBOOST_NATIVE_BUILD_TIMEOUT_S (default 300 s), or on any interruption, the whole group is killed
    (killing the driver alone left g++'s cc1plus running, gigabytes of it, beside the fallback)."""
    try:
        timeout = float(os.environ.get(BUILD_TIMEOUT_ENV) or BUILD_TIMEOUT_S)
    except ValueError:
        timeout = -1.0
    if not 0 < timeout < 1e9:                   # nan, inf, negative: communicate() raises on some of them
        raise RuntimeError(f"${BUILD_TIMEOUT_ENV}={os.environ[BUILD_TIMEOUT_ENV]!r} is not a number of seconds > 0")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, errors="replace",
                            start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except BaseException:
        try:
            os.killpg(proc.pid, 9)
        except OSError:
            pass
        proc.wait()
        raise
    return proc.returncode, stderr


def _declare(lib) -> None:
    p = ctypes.c_void_p
    lib.kvb_decoder_new.restype = p
    lib.kvb_decoder_new.argtypes = [p, ctypes.c_char_p, ctypes.c_int]
    lib.kvb_decoder_rows.restype = ctypes.c_int
    lib.kvb_decoder_rows.argtypes = [p, ctypes.c_int, p, p, p]
    lib.kvb_struct_size.restype = ctypes.c_int64
    lib.kvb_struct_size.argtypes = [ctypes.c_int]
    lib.kvb_decoder_embed.restype = ctypes.c_int
    lib.kvb_decoder_embed.argtypes = [p, ctypes.c_int, p, p]
    lib.kvb_decoder_int8_queries.restype = ctypes.c_int
    lib.kvb_decoder_int8_queries.argtypes = [p]
    lib.kvb_decoder_free.restype = None
    lib.kvb_decoder_free.argtypes = [p]
    lib.kvb_isa.restype = ctypes.c_char_p
    lib.kvb_isa.argtypes = []
