"""A thread that hands work to the scheduler gives its OpenMP workers back while it waits.

PyTorch's CPU kernels run on libgomp thread teams: one pool of worker threads per OS thread that
has run a parallel op. Once libgomp manages more threads than there are CPUs, it cuts the
spin-wait of idle workers between parallel regions to about a hundred iterations, so each of the
~1,800 small ops of a decode step pays a futex wake-up. The caller's pool is exactly that surplus:
the thread that loaded the model (and tokenized the prompt) keeps its idle workers while the
scheduler thread runs the forwards. Measured on 2 cores (SmolLM2-135M, one decode step): 45 ms on
the main thread, 69-75 ms on another thread while the main thread's pool exists, 45 ms once it is
released. So `submit` releases the calling thread's pool (`omp_pause_resource_all`, OpenMP 5.0:
libgomp frees the calling thread's pool only, and creates it again at that thread's next parallel
op, in well under a millisecond).

Only libgomp (the OpenMP runtime PyTorch's Linux wheels ship) is touched; with another runtime
or another parallel backend this does nothing.
"""
from __future__ import annotations

import ctypes
import glob
import os
import threading

import torch

_OMP_PAUSE_SOFT = 1
_lock = threading.Lock()
_pause = None           # libgomp's omp_pause_resource_all, once found; False when there is none


def _find_pause():
    if "OpenMP" not in torch.__config__.parallel_info():
        return False
    for path in sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*"))):
        try:
            function = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        function.argtypes, function.restype = [ctypes.c_int], ctypes.c_int
        return function
    return False


def release_thread_pool() -> bool:
    """Free the calling thread's idle OpenMP workers (not those of any other thread); True when
    libgomp took the request. Call it from a thread that is about to wait, never inside a
    parallel region."""
    global _pause
    with _lock:
        if _pause is None:
            _pause = _find_pause()
    return bool(_pause) and _pause(_OMP_PAUSE_SOFT) == 0
