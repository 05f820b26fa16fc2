"""Faults at the native library's interface (native/decode.cpp): a step whose scratch memory cannot be
allocated, or whose row is out of range, fails as a Python error with nothing computed and no KV
written (an exception out of the library would end the process); a model whose shapes or scale types
the kernels do not read is refused with the reason, and the engine runs it on PyTorch."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvboost_engine import Engine
from kvboost_engine.kv.contiguous import SequenceKV
from kvboost_engine.model.arch import ModelAdapter
from kvboost_engine.native import abi, build
from kvboost_engine.native.decoder import native_decoder
from kvboost_engine.weights.quantized import convert_model
from tiny_models import tiny_model

_CANNOT = build.cpu_reason() or (None if build.compiler() else "no C++ compiler")
pytestmark = pytest.mark.skipif(_CANNOT is not None, reason=str(_CANNOT))
PROMPT = [5, 900, 17, 3000, 42, 7, 123, 4567, 89, 10, 11, 12]
WIDE = dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=4)


def _decoder(tmp_path, weights: str):
    model = tiny_model("llama", seed=4, **WIDE)
    if weights == "int4":
        convert_model(model, "int4", cache_dir=tmp_path)
    adapter = ModelAdapter(model)
    decoder, reason = native_decoder(adapter, threads=2)
    assert decoder is not None, reason
    return adapter, decoder


def _state(kv) -> list[torch.Tensor]:
    """The KV's buffers as bytes (slots never written hold whatever memory held, NaN bit patterns too)."""
    return [t.contiguous().view(torch.uint8).clone() for t in kv.slot_view()]


@pytest.mark.parametrize("weights", ["float", "int4"])
def test_a_step_the_library_cannot_hold_or_place_fails_alone(tmp_path, weights):
    """Rows whose attention partials pass what the library's offsets hold (64 rows at 2^31 - 1), or a
    position past its range: MemoryError / ValueError, the KV untouched, and the next step's numbers
    those of a decoder that never failed."""
    adapter, decoder = _decoder(tmp_path, weights)
    kv, twin = SequenceKV(adapter.geometry, 64, adapter.device), SequenceKV(adapter.geometry, 64, adapter.device)
    with torch.inference_mode():
        decoder.prefill(kv, PROMPT, 0)
        decoder.prefill(twin, PROMPT, 0)
        want = decoder(twin, 77, len(PROMPT))
        before = _state(kv)
        view, tables = kv.slot_view(), decoder._rotary(len(PROMPT))
        with pytest.raises(MemoryError, match="partials for 64 rows pass the 2"):
            decoder._step([(view, 2**31 - 1, True, tables)] * 64, [77] * 64)
        with pytest.raises(ValueError, match="position out of range"):
            decoder._step([(view, 2**31, True, tables)], [77])
        assert all(torch.equal(a, b) for a, b in zip(before, _state(kv)))
        assert torch.equal(decoder(kv, 77, len(PROMPT)), want)


def test_a_step_whose_memory_runs_out_raises_memory_error_and_the_process_goes_on(tmp_path):
    """A real allocation failure (the address space limited, so a 2 GiB buffer of attention partials
    cannot be had), in a process of its own: MemoryError in Python, not std::terminate, the KV untouched,
    and once memory is back the same decoder steps with the numbers it gave before."""
    script = textwrap.dedent(f"""
        import resource, sys
        import torch
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from kvboost_engine.kv.contiguous import SequenceKV
        from kvboost_engine.model.arch import ModelAdapter
        from kvboost_engine.native.decoder import native_decoder
        from tiny_models import tiny_model
        adapter = ModelAdapter(tiny_model("llama", seed=4, hidden_size=128, num_attention_heads=8, num_key_value_heads=4))
        decoder, reason = native_decoder(adapter, threads=2)
        assert decoder is not None, reason
        kv, twin = (SequenceKV(adapter.geometry, 64, adapter.device) for _ in range(2))
        prompt = {PROMPT!r}
        with torch.inference_mode():
            decoder.prefill(kv, prompt, 0)
            decoder.prefill(twin, prompt, 0)
            want = decoder(twin, 77, len(prompt))
            state = lambda: [t.contiguous().view(torch.uint8).clone() for t in kv.slot_view()]   # bytes
            before = state()
            view, tables = kv.slot_view(), decoder._rotary(len(prompt))
            soft, hard = resource.getrlimit(resource.RLIMIT_AS)
            with open("/proc/self/statm") as f:
                used = int(f.read().split()[0]) * resource.getpagesize()
            resource.setrlimit(resource.RLIMIT_AS, (used + (256 << 20), hard))
            try:
                # 8 heads x 2^22 key blocks x 16 floats: 2 GiB of partials
                decoder._step([(view, 2**30, True, tables)], [77])
                print("NO ERROR")
            except MemoryError as err:
                print("MemoryError:", err)
            finally:
                resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
            assert all(torch.equal(a, b) for a, b in zip(before, state()))
            assert torch.equal(decoder(kv, 77, len(prompt)), want)
            print("AFTER OK")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "MemoryError: the native step could not allocate its scratch memory for 1 rows" in done.stdout
    assert "AFTER OK" in done.stdout


def _corrupting(monkeypatch, change):
    """abi.mat_args with `change(index, MatArgs)` applied to each matrix it describes (in the order
    decoder.py asks: q, k, v, o, gate, up, down of each layer, then the head)."""
    real, count = abi.mat_args, [0]

    def mat_args(mat, hold):
        args = real(mat, hold)
        change(count[0], args)
        count[0] += 1
        return args
    monkeypatch.setattr(abi, "mat_args", mat_args)


@pytest.mark.parametrize("fault, reason", [
    ("rows", "layer 0's o is 144 x 128, expected 128 x 128"),
    ("types", "layer 0's o has scale types d 4, m 0 the kernels do not read"),
    ("head", "the head is 49136 x 128, expected 49152 x 128"),
])
def test_the_library_refuses_a_model_it_cannot_run_with_the_reason(tmp_path, monkeypatch, fault, reason):
    """Shapes and scale types are checked by the library too (Python guards them before it): a matrix
    of the wrong shape or a scale pair the kernels do not read is refused with the reason
    (native_decoder -> None, why), where it once ran and wrote past its buffers or left outputs unset."""
    model = tiny_model("llama", seed=4, **WIDE)
    convert_model(model, "int4", cache_dir=tmp_path)
    head = 7 * len(model.model.layers)

    def change(i, args):
        if fault == "rows" and i == 3:
            args.rows += 16
        if fault == "types" and i == 3:
            args.d_type = 4                                  # uint8 d with a bf16 m: no kernel reads that pair
        if fault == "head" and i == head:
            args.rows -= 16
    _corrupting(monkeypatch, change)
    decoder, why = native_decoder(ModelAdapter(model), threads=2)
    assert decoder is None and why == f"the native library refused the model: {reason}"


def test_an_engine_whose_model_the_library_refuses_runs_on_pytorch_with_the_reason(tmp_path, monkeypatch):
    """The refusal reaches stats() (native_decode_off), the engine generates on the PyTorch path, and
    native_decode=True says why it cannot."""
    from transformers import AutoTokenizer

    from kvboost_engine import InputError
    from kvboost_engine.loading import default_model_dir
    model = tiny_model("llama", seed=4, **WIDE)
    convert_model(model, "int4", cache_dir=tmp_path)
    per_model = 7 * len(model.model.layers) + 1                # matrices each decoder describes
    _corrupting(monkeypatch, lambda i, args: setattr(args, "rows", args.rows + 16) if i % per_model == 3 else None)
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    engine = Engine(model, tokenizer, cache_bytes=0)
    stats = engine.stats()
    assert stats["native_decode"] is False
    assert stats["native_decode_off"] == "the native library refused the model: layer 0's o is 144 x 128, expected 128 x 128"
    assert len(engine.generate("Hello", max_new_tokens=3, min_new_tokens=3).token_ids) == 3
    with pytest.raises(InputError, match="refused the model"):
        Engine(model, tokenizer, cache_bytes=0, native_decode=True)
