"""A thread that hands a request to the scheduler (or builds an engine) gives its idle OpenMP
workers back, so the scheduler thread's ops are not slowed by libgomp's oversubscription mode."""
import os
import threading

import pytest
import torch

from kvboost_engine.request import openmp


def _threads() -> int:
    return len(os.listdir(f"/proc/{os.getpid()}/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_release_frees_the_calling_threads_workers_and_torch_works_after():
    if torch.get_num_threads() < 2 or not openmp._find_pause():
        pytest.skip("no libgomp pool to release (one thread, or another OpenMP runtime)")
    out = {}

    def work():
        a = torch.randn(512, 512, generator=torch.Generator().manual_seed(0))
        (a @ a).sum()                                   # a parallel region: this thread's pool exists
        before = _threads()
        out["released"] = openmp.release_thread_pool()
        out["fewer"] = before - _threads()
        out["after"] = a @ a                            # the pool comes back on the next parallel op
        out["expected"] = (a.double() @ a.double()).float()

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert out["released"] and out["fewer"] >= 1
    torch.testing.assert_close(out["after"], out["expected"], rtol=1e-4, atol=1e-3)   # element by element: a
    # sum of the product lands near zero for some draws, where float32 rounding is above 1e-4 of it


def test_release_is_harmless_without_a_pool_and_when_called_twice():
    assert openmp.release_thread_pool() in (True, False)
    assert openmp.release_thread_pool() in (True, False)
    assert float(torch.ones(4).sum()) == 4.0
