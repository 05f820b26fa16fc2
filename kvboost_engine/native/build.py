"""Build decode.cpp once per source, compiler and machine kind; load it with ctypes.

The library is compiled with the system C++ compiler (`$CXX`, else g++, else c++) for AVX512 with
VNNI (named instruction sets, never `-march=native`: some VMs advertise extensions they cannot
run) into `$KVBOOST_HOME/native/`, under a name keyed by the source and the compiler, so a later
process loads it without compiling. Anything missing (not x86-64 Linux, a CPU without those
instructions, no compiler, a failed build) is reported as a reason, never raised: callers fall
back to the PyTorch path.

It is built with OpenMP: its `libgomp.so.1` is, by soname, the one PyTorch's Linux wheels ship and
have already loaded, so a step runs on the calling thread's own OpenMP team, the threads its
PyTorch ops use (a second runtime's threads would compete with them for the cores).
"""
from __future__ import annotations

import ctypes
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import xxhash

from ..paths import build_lock, cache_home
from . import abi

SOURCE = Path(__file__).with_name("decode.cpp")
ABI_VERSION = 5
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-pthread", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl",
         "-mavx512dq", "-mavx512vnni", "-mfma")
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "fma")
log = logging.getLogger(__name__)
_loaded: dict[str, object] = {}
_lock = threading.Lock()


def cpu_reason() -> str | None:
    """Why this machine cannot run the native step (None: it can)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"native decode needs x86-64 Linux (this is {platform.system()} {platform.machine()})"
    try:
        with open("/proc/cpuinfo") as info:
            flags = next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), [])
    except OSError as err:
        return f"cannot read /proc/cpuinfo ({err})"
    missing = [flag for flag in CPU_FLAGS if flag not in flags]
    return f"the CPU lacks {', '.join(missing)}" if missing else None


def compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def library_path(cxx: str) -> Path:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    key = xxhash.xxh3_64_hexdigest("\0".join([SOURCE.read_text(), cxx, *version, *FLAGS]).encode())
    return cache_home() / "native" / f"kvboost-decode-{key}.so"


def load() -> tuple[object | None, str | None]:
    """(the loaded library, None), or (None, why not). Builds it on first use; cached per process."""
    with _lock:
        if "lib" in _loaded:
            return _loaded["lib"], _loaded["reason"]
        lib, reason = None, cpu_reason()
        if reason is None:
            lib, reason = _build_and_open()
        if reason is not None:
            log.info("kvboost native decode off: %s", reason)
        _loaded.update(lib=lib, reason=reason)
        return lib, reason


def _build_and_open() -> tuple[object | None, str | None]:
    cxx = compiler()
    if cxx is None:
        return None, "no C++ compiler found (set CXX, or install g++)"
    path = library_path(cxx)
    try:
        if not path.exists():
            with build_lock(path):
                if not path.exists():
                    _compile(cxx, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError, RuntimeError) as err:
        return None, f"building {SOURCE.name} failed: {err}"
    if lib.kvb_abi_version() != ABI_VERSION:
        return None, f"{path} has ABI {lib.kvb_abi_version()}, expected {ABI_VERSION}"
    _declare(lib)
    structs = (abi.MatArgs, abi.LayerArgs, abi.ModelArgs, abi.Row)
    if [lib.kvb_struct_size(i) for i in range(4)] != [ctypes.sizeof(s) for s in structs]:
        return None, f"{path}: the C structures' sizes differ from native/abi.py's"
    return lib, None


def _compile(cxx: str, path: Path) -> None:
    handle, staging = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=path.parent)
    os.close(handle)
    try:
        done = subprocess.run([cxx, *FLAGS, str(SOURCE), "-o", staging], capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(" | ".join(done.stderr.strip().splitlines()[-3:])[-500:])
        os.replace(staging, path)
    finally:
        if os.path.exists(staging):
            os.remove(staging)


def _declare(lib) -> None:
    p = ctypes.c_void_p
    lib.kvb_decoder_new.restype = p
    lib.kvb_decoder_new.argtypes = [p]
    lib.kvb_decoder_rows.restype = None
    lib.kvb_decoder_rows.argtypes = [p, ctypes.c_int, p, p, p]
    lib.kvb_struct_size.restype = ctypes.c_int64
    lib.kvb_struct_size.argtypes = [ctypes.c_int]
    lib.kvb_decoder_free.restype = None
    lib.kvb_decoder_free.argtypes = [p]
