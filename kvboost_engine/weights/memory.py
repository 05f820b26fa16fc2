"""Process memory: peak RSS, and handing freed heap pages back to the OS."""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import sys


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (0 where the platform does not say)."""
    try:
        import resource                                 # POSIX only
    except ImportError:
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024     # macOS reports bytes, Linux KiB


def release_free_memory(collect: bool = False) -> bool:
    """Hand free heap pages back to the OS (glibc `malloc_trim`), after a garbage collection
    when `collect` (slow in a process with many Python objects: leave it to the last call).

    Freed tensors below glibc's mmap threshold stay in the heap and keep counting toward
    RSS; trimming returns them. Returns whether a trim ran (False off glibc)."""
    if collect:
        gc.collect()
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


_LIBC: list = []


def _libc():
    if not _LIBC:
        name = ctypes.util.find_library("c") if sys.platform.startswith("linux") else None
        lib = ctypes.CDLL(name) if name else None
        _LIBC.append(lib if lib is not None and hasattr(lib, "malloc_trim") else None)
    return _LIBC[0]
