"""Loading without load-time temporaries: dtype-converting reads are chunked, free pages go back."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file

from kvboost_engine.weights.checkpoint import Checkpoint
from kvboost_engine.weights.memory import release_free_memory


@pytest.fixture
def fp16_checkpoint(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {"embed": torch.randn(1000, 72, generator=gen).half(), "ids": torch.arange(12, dtype=torch.int32)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path, tensors


@pytest.mark.parametrize("chunk_bytes", [64, 1000, 4 << 20])
def test_copy_into_converts_exactly_in_any_chunking(fp16_checkpoint, chunk_bytes):
    path, tensors = fp16_checkpoint
    out = torch.empty(1000, 72, dtype=torch.float32)
    Checkpoint(path).copy_into("embed", out, chunk_bytes=chunk_bytes)
    assert torch.equal(out, tensors["embed"].float())


def test_copy_into_same_dtype_and_shape_check(fp16_checkpoint):
    path, tensors = fp16_checkpoint
    ckpt = Checkpoint(path)
    out = torch.empty(12, dtype=torch.int32)
    ckpt.copy_into("ids", out)
    assert torch.equal(out, tensors["ids"])
    with pytest.raises(ValueError, match="stored"):
        ckpt.copy_into("embed", torch.empty(72, 1000))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is Linux-only")
def test_fp16_to_fp32_load_adds_no_full_size_temporary(fp16_checkpoint, tmp_path):
    """Peak RSS while loading a 64 MB fp16 tensor into a touched fp32 target grows by the chunk
    buffer only (the old `read().to(fp32)` path added 64 + 128 MB)."""
    big = tmp_path / "big"
    big.mkdir()
    save_file({"w": torch.ones(8192, 4096, dtype=torch.float16)}, str(big / "model.safetensors"))
    script = textwrap.dedent(f"""
        import torch
        from kvboost_engine.weights.checkpoint import Checkpoint
        def hwm():
            return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) * 1024
        out = torch.zeros(8192, 4096)
        ckpt = Checkpoint({str(big)!r})
        before = hwm()
        ckpt.copy_into("w", out)
        grown = hwm() - before
        assert bool(out[::97].eq(1).all()) and bool(out[-1].eq(1).all())
        print(grown)
    """)
    grown = int(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
                .stdout.split()[-1])
    assert grown < 24 * 2**20, grown


def test_release_free_memory_runs():
    assert release_free_memory() is sys.platform.startswith("linux")
