"""AWQ checkpoints and layer streaming under faults and bad input: damaged or cut-short pack files
are written again, a failed layer load frees its slot, bad options and misfit checkpoints are clear
errors, the quantizer refuses what its folding cannot keep and never leaves a mixed checkpoint,
and each kernel's KV is its own in the cache identity."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from awq_helpers import write_tiny_awq
from kvboost_engine import InputError, UnsupportedModelError
from kvboost_engine.model.arch import SUPPORTED_ARCHITECTURES
from kvboost_engine.model.fingerprint import model_fingerprint
from kvboost_engine.weights.awq.kernels import DequantLayout, cpu_int4pack_works
from kvboost_engine.weights.awq.linear import AWQLinear
from kvboost_engine.weights.awq.loader import awq_modules, load_awq_model
from kvboost_engine.weights.residency import LayerBinding
from kvboost_engine.weights.streamer import LayerStreamer
from kvboost_engine.weights.checkpoint import read_header
from kvboost_engine.weights.tiers import HostRamTier, write_pack_file
from kvboost_tools.awq import quantize
from kvboost_tools.awq.grid import fake_quantize, quantize_groups
from tiny_models import tiny_model

CPU = torch.device("cpu")
IDS = torch.tensor([[5, 17, 300, 2, 9, 44]])


@pytest.fixture(scope="module")
def llama_awq(tmp_path_factory):
    path = tmp_path_factory.mktemp("awq") / "tiny-llama-awq"
    write_tiny_awq(path, "llama", search=False, num_hidden_layers=4)
    return path


def _load(path, **options):
    return load_awq_model(path, device=CPU, dtype=torch.float32, **options)


def test_a_cut_short_or_damaged_pack_file_is_written_again(llama_awq, tmp_path):
    packs = tmp_path / "packs"
    model = _load(llama_awq, resident_layers=0, pack_dir=packs)
    with torch.no_grad():
        want = model(IDS).logits
    pack = model.kvboost_awq.pack_file
    model.kvboost_streamer.close()
    size = os.path.getsize(pack)
    for damage in ("truncate", "header", "length", "bytes"):
        if damage == "bytes":                    # flipped inside the data, header and length intact: streamed
            with open(pack, "r+b") as f:         # as they were before (garbage answers, no error)
                f.seek(size - 4096)
                block = f.read(256)
                f.seek(size - 4096)
                f.write(bytes(b ^ 0xFF for b in block))
        elif damage == "truncate":
            os.truncate(pack, size // 2)         # a partial copy of the cache: failed mid-request before
        elif damage == "length":
            with open(pack, "r+b") as f:         # a garbage header length: MemoryError / OverflowError
                f.write(b"AAAAAAAA")
        else:
            with open(pack, "r+b") as f:         # failed every later load before
                f.seek(8)
                f.write(b"#garbage#")
        model = _load(llama_awq, resident_layers=0, pack_dir=packs)
        with torch.no_grad():
            assert torch.equal(model(IDS).logits, want), damage
        model.kvboost_streamer.close()
        assert os.path.getsize(pack) == size


def test_one_pack_serves_every_residency(llama_awq, tmp_path):
    """A pack per residency set left one model-sized file per setting tried (three settings of the
    default model: 173 MB of packs for 56 MB of streamed layers); an older version's such packs go."""
    import shutil
    packs = tmp_path / "packs"
    outputs, paths = [], set()
    for resident in (0, 2, 1, 0):
        model = _load(llama_awq, resident_layers=resident, pack_dir=packs)
        with torch.no_grad():
            outputs.append(model(IDS).logits)
        paths.add(model.kvboost_awq.pack_file)
        model.kvboost_streamer.close()
        if resident == 2:       # an older version's pack of this checkpoint (no torch / cpu in its metadata)
            header, _ = read_header(model.kvboost_awq.pack_file)
            old = {k: v for k, v in header["__metadata__"].items() if k not in ("torch", "cpu")}
            write_pack_file(packs / "0123456789abcdef.safetensors", {0: 64}, iter([(0, torch.zeros(64, dtype=torch.uint8))]), old)
            shutil.copy(packs / "0123456789abcdef.safetensors", packs / "fedcba9876543210.safetensors")
            write_pack_file(packs / "1111111111111111.safetensors", {0: 64}, iter([(0, torch.zeros(64, dtype=torch.uint8))]),
                            {**old, "weights_digest": "another checkpoint"})
    assert len(paths) == 1 and all(torch.equal(o, outputs[0]) for o in outputs)
    assert sorted(p.name for p in packs.glob("*.safetensors")) == sorted([os.path.basename(paths.pop()),
                                                                          "1111111111111111.safetensors"])


def test_a_load_checks_the_layers_it_streams_only(llama_awq, tmp_path):
    """One pack holds every layer: a load streaming one layer must not read the whole model to check it."""
    packs = tmp_path / "packs"
    model = _load(llama_awq, resident_layers=0, pack_dir=packs)
    pack = model.kvboost_awq.pack_file
    model.kvboost_streamer.close()
    header, base = read_header(pack)
    start, _ = header["layers.0"]["data_offsets"]
    with open(pack, "r+b") as f:                 # layer 0 damaged: resident in the next load (read from the checkpoint)
        f.seek(base + start)
        f.write(b"\xff" * 64)
    written = os.stat(pack).st_mtime_ns
    model = _load(llama_awq, resident_layers=3, pack_dir=packs)          # layers 0, 1, 3 resident: streams layer 2 alone
    model.kvboost_streamer.close()
    assert os.stat(pack).st_mtime_ns == written
    model = _load(llama_awq, resident_layers=0, pack_dir=packs)          # streams layer 0: written again
    model.kvboost_streamer.close()
    assert os.stat(pack).st_mtime_ns != written


def test_a_killed_pack_writers_file_is_pruned(llama_awq, tmp_path):
    """A kill -9 mid-write left its temporary file (the pack's size) for good: no prefix the
    staging pruner knows."""
    packs = tmp_path / "packs"
    packs.mkdir()
    left = packs / ".pack-0123456789abcdef.safetensors.99999.tmp"
    left.write_bytes(b"x" * 100)
    os.utime(left, (1, 1))                               # a day old and more
    model = _load(llama_awq, resident_layers=0, pack_dir=packs)
    model.kvboost_streamer.close()
    assert not left.exists()


def test_a_pack_write_that_fails_names_the_file(tmp_path):
    def blobs():
        yield 0, torch.zeros(64, dtype=torch.uint8)
        raise OSError(28, "No space left on device")
    target = tmp_path / "p.safetensors"
    with pytest.raises(OSError, match="p.safetensors.*No space left.*KVBOOST_HOME") as err:
        write_pack_file(target, {0: 64, 1: 64}, blobs(), {"format": "x"})
    assert err.value.errno == 28
    assert list(tmp_path.iterdir()) == []


def test_a_pack_cut_short_while_running_names_the_file(llama_awq, tmp_path):
    model = _load(llama_awq, resident_layers=0, pack_dir=tmp_path / "packs")
    pack = model.kvboost_awq.pack_file
    os.truncate(pack, 1024)
    with pytest.raises(OSError) as err, torch.no_grad():
        model(IDS)
    assert f"pack file {pack}" in str(err.value)        # it was "short read at offset 1024"
    model.kvboost_streamer.close()


def test_an_interrupted_pack_write_leaves_nothing(tmp_path):
    def blobs():
        yield 0, torch.zeros(64, dtype=torch.uint8)
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        write_pack_file(tmp_path / "p.safetensors", {0: 64, 1: 64}, blobs(), {"format": "x"})
    assert list(tmp_path.iterdir()) == []


class _FlakyTier(HostRamTier):
    """Host RAM whose next `fail` loads of layer `bad` raise OSError (a read error on the pack file)."""

    def __init__(self, blobs, bad, fail):
        super().__init__(blobs)
        self.bad, self.fail = bad, fail

    def source(self, layer, staging):
        if layer == self.bad and self.fail > 0:
            self.fail -= 1
            raise OSError(5, "Input/output error (test)")
        return super().source(layer, staging)


def test_a_failed_layer_load_frees_its_slot_and_is_retried():
    """It kept its slot (the streamer down one slot for good), and after two failures every pass
    raised KeyError."""
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(AWQLinear(64, 64, 32, DequantLayout(), False)) for _ in range(3)]
    bindings = {i: LayerBinding(awq_modules(layer)) for i, layer in enumerate(layers)}
    blobs = {i: bindings[i].pack([DequantLayout().prepare(*quantize_groups(torch.randn(64, 64), 32), 32)])
             for i in bindings}
    reference = LayerStreamer(layers, bindings, HostRamTier(dict(blobs)), 2, CPU)
    x = torch.randn(1, 64)
    with torch.no_grad():
        want = layers[2](layers[1](layers[0](x)))
    reference.close()
    streamer = LayerStreamer(layers, bindings, _FlakyTier(blobs, bad=2, fail=2), 2, CPU)
    failures = 0
    with torch.no_grad():
        for _ in range(4):
            try:
                got = layers[2](layers[1](layers[0](x)))
            except OSError:
                failures += 1
                continue
            assert torch.equal(got, want)
            assert len(streamer._free) + len(streamer._inflight) == len(streamer.slots)
    assert failures == 2
    streamer.close()


@pytest.mark.parametrize("options,match", [
    ({"kernel": "DEQUANT"}, "unknown awq_kernel"),
    ({"kernel": "awq-ext"}, "runs on CUDA"),
    ({"resident_layers": 0, "staging_slots": 1}, "staging_slots"),
    ({"resident_layers": 0, "staging_slots": "2"}, "staging_slots"),
    ({"resident_bytes": "1GB"}, "resident_bytes"),
    ({"resident_layers": True}, "resident_layers"),
])
def test_bad_awq_options_are_input_errors(llama_awq, tmp_path, options, match):
    with pytest.raises(InputError, match=match):
        _load(llama_awq, pack_dir=tmp_path, **options)
    assert not list(tmp_path.iterdir())                 # refused before any pack file is written


def test_a_checkpoint_that_does_not_fit_its_config_is_refused(llama_awq, tmp_path):
    """A config's group size over another's tensors: an assert deep in the packing before."""
    import shutil
    misfit = tmp_path / "misfit"
    shutil.copytree(llama_awq, misfit)
    config = json.loads((misfit / "config.json").read_text())
    config["quantization_config"]["group_size"] = 64
    (misfit / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="qzeros"):
        _load(misfit)


@pytest.mark.parametrize("part,dtype", [("qweight", torch.int16), ("qweight", torch.float32),
                                        ("qzeros", torch.uint8), ("scales", torch.int32)])
def test_awq_tensors_of_another_dtype_are_refused(llama_awq, tmp_path, part, dtype):
    """int16 / uint8 / int32 loaded and answered other tokens; float32 qweight failed in a shift op."""
    import shutil
    from safetensors.torch import load_file, save_file
    damaged = tmp_path / "damaged"
    shutil.copytree(llama_awq, damaged)
    for file in damaged.glob("*.safetensors"):
        tensors = load_file(file)
        name = next((k for k in tensors if k.endswith(f"mlp.down_proj.{part}")), None)
        if name is not None:
            tensors[name] = tensors[name].to(dtype)
            save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match=f"down_proj.{part} is {str(dtype).removeprefix('torch.')}"):
        _load(damaged, pack_dir=tmp_path / "packs")


@pytest.mark.skipif(not cpu_int4pack_works(), reason="no CPU int4 kernel in this PyTorch")
def test_each_kernel_is_its_own_cache_identity(llama_awq):
    """Their numbers differ, so one's KV is no exact hit for the other (it was: the same fingerprint)."""
    a, b = _load(llama_awq, kernel="dequant"), _load(llama_awq, kernel="cpu-int4pack")
    assert model_fingerprint(a, {}) != model_fingerprint(b, {})
    assert model_fingerprint(a, {}) == model_fingerprint(_load(llama_awq, kernel="dequant"), {})


@pytest.mark.skipif("gemma3_text" not in SUPPORTED_ARCHITECTURES, reason="Gemma 3 needs transformers 5")
def test_a_gemma3_awq_checkpoint_scales_its_embeddings(tmp_path):
    """Its embedding scale (sqrt(hidden), a buffer not in the file) was left as uninitialised memory."""
    model = tiny_model("gemma3_text")
    reference = tiny_model("gemma3_text")            # its decoder weights as the checkpoint holds them
    for name, module in reference.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in name:
            module.weight.data = fake_quantize(module.weight.data, 32)
    quantize.save_checkpoint(model, quantize.quantized_state(model, 32, {}), tmp_path, 32)
    loaded = _load(tmp_path, kernel="dequant")
    scale = loaded.model.embed_tokens.embed_scale
    assert math.isclose(float(scale), model.config.hidden_size ** 0.5, rel_tol=1e-6)
    with torch.no_grad():
        want, got = reference(IDS).logits, loaded(IDS).logits
    assert (got - want).norm() / want.norm() < 0.01          # 1.0 before: noise


def test_the_quantizer_refuses_what_its_folding_cannot_keep():
    for model_type in ("gemma3_text", "phi3"):    # Gemma's norms scale by 1 + w: folding changed its float model
        if model_type in SUPPORTED_ARCHITECTURES:
            with pytest.raises(ValueError, match="quantizer takes"):
                quantize.quantize_model(tiny_model(model_type), None, 32)
    with pytest.raises(ValueError, match="32, 64 or 128"):
        quantize.quantize_model(tiny_model("llama"), None, 48)
    with pytest.raises(ValueError, match="whole number of groups"):
        quantize.quantize_model(tiny_model("llama"), None, 128)      # 64 inputs


def test_an_interrupted_save_leaves_the_old_checkpoint(llama_awq, tmp_path, monkeypatch):
    import shutil
    out = tmp_path / "out"
    shutil.copytree(llama_awq, out)
    model = tiny_model("llama", num_hidden_layers=4)
    state = quantize.quantized_state(model, 64, {})

    def dies(state, path, metadata=None):         # part of the new weights written, then killed
        with open(path, "wb") as f:
            f.write(b"\0" * 1000)
        raise KeyboardInterrupt
    monkeypatch.setattr(quantize, "save_file", dies)
    with pytest.raises(KeyboardInterrupt):
        quantize.save_checkpoint(model, state, out, 64)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in llama_awq.iterdir())
    with torch.no_grad():
        assert torch.equal(_load(out)(IDS).logits, _load(llama_awq)(IDS).logits)
