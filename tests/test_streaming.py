"""Layer streaming: residency plans, slot binding, the prefetch scheduler, and end-to-end identity."""
from __future__ import annotations

import time

import pytest
import torch

from awq_helpers import write_tiny_awq
from kvboost_engine import Engine
from kvboost_engine.weights.awq.loader import awq_modules, load_awq_model
from kvboost_engine.errors import BudgetError, InputError
from kvboost_engine.weights.residency import LayerBinding, resident_layers_set
from kvboost_engine.weights.streamer import LayerStreamer
from kvboost_engine.weights.tiers import HostRamTier

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny_awq(tmp_path_factory):
    path = tmp_path_factory.mktemp("awq") / "tiny-llama-awq"
    write_tiny_awq(path, "llama", num_hidden_layers=4)
    return path


def test_resident_split_first_and_last():
    assert resident_layers_set(30, 2) == {0, 29}
    assert resident_layers_set(30, 3) == {0, 1, 29}
    assert resident_layers_set(4, None) == {0, 1, 2, 3}
    assert resident_layers_set(4, 0) == frozenset()
    assert resident_layers_set(4, 9) == {0, 1, 2, 3}
    with pytest.raises(InputError):
        resident_layers_set(4, -1)


def test_resident_byte_budget_counts_staging():
    sizes = [100] * 6
    assert resident_layers_set(6, layer_bytes=sizes, resident_bytes=600) == set(range(6))
    assert resident_layers_set(6, layer_bytes=sizes, resident_bytes=599) == {0, 1, 5}   # 3 layers + 2 slots
    with pytest.raises(BudgetError):
        resident_layers_set(6, layer_bytes=sizes, resident_bytes=150)


def test_streaming_logits_identical_to_resident(tiny_awq):
    ids = torch.tensor([[5, 17, 300, 2, 9, 44]])
    resident = load_awq_model(tiny_awq, device=CPU, dtype=torch.float32)
    streamed = load_awq_model(tiny_awq, device=CPU, dtype=torch.float32, resident_layers=1)
    with torch.no_grad():
        want = resident(ids).logits
        for _ in range(3):                        # several passes: the cyclic prefetch wraps around
            assert torch.equal(streamed(ids).logits, want)
    info = streamed.kvboost_awq
    assert (info.resident_layers, info.streamed_layers) == (1, 3)
    # streamed layers hold no weights between uses
    for index in (1, 2, 3):
        assert all(m.tensors is None for m in awq_modules(streamed.model.layers[index]))


def test_greedy_generation_token_identical(tiny_awq):
    prompt = "The kernel reads the weights"
    full = Engine.from_pretrained(tiny_awq, cache_bytes=0, awq_kernel="cpu-int4pack").generate(prompt, max_new_tokens=12, min_new_tokens=12)
    engine = Engine.from_pretrained(tiny_awq, cache_bytes=2**26, resident_layers=2)
    first = engine.generate(prompt, max_new_tokens=12, min_new_tokens=12)
    again = engine.generate(prompt, max_new_tokens=12, min_new_tokens=12)     # through the chunk cache
    assert first.token_ids == full.token_ids == again.token_ids
    assert again.reused_tokens > 0
    stats = engine.stats()
    assert stats["streamed_layers"] == 2 and stats["stream_bytes"] > 0
    assert stats["stream_bytes_per_pass"] == stats["streamed_layer_bytes"]
    assert 0 <= stats["prefetch_hit_rate"] <= 1 and stats["peak_rss_bytes"] > 0


def test_ram_tier_and_three_slots_identical(tiny_awq):
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        want = load_awq_model(tiny_awq, device=CPU, dtype=torch.float32)(ids).logits
        model = load_awq_model(tiny_awq, device=CPU, dtype=torch.float32, resident_layers=0,
                               stream_from="ram", staging_slots=3)
        assert torch.equal(model(ids).logits, want)
        assert model.kvboost_streamer.telemetry()["stream_tier"] == "ram"


def test_pack_file_written_once(tiny_awq, tmp_path):
    first = load_awq_model(tiny_awq, device=CPU, dtype=torch.float32, resident_layers=2, pack_dir=tmp_path)
    path = first.kvboost_awq.pack_file
    stamp = __import__("os").stat(path).st_mtime_ns
    second = load_awq_model(tiny_awq, device=CPU, dtype=torch.float32, resident_layers=2, pack_dir=tmp_path)
    assert second.kvboost_awq.pack_file == path and __import__("os").stat(path).st_mtime_ns == stamp


def test_recovers_from_out_of_order_and_failed_layers(tiny_awq):
    model = load_awq_model(tiny_awq, device=CPU, dtype=torch.float32, resident_layers=0)
    ids = torch.tensor([[7, 8, 9]])
    with torch.no_grad():
        want = model(ids).logits
        streamer = model.kvboost_streamer
        streamer.before_layer(2)                 # out of order: resynchronises
        assert all(m.tensors is not None for m in awq_modules(model.model.layers[2]))
        # a layer that raised never reached after_layer; the next forward must still be right
        assert torch.equal(model(ids).logits, want)
    assert streamer.stats.resyncs >= 1


class SlowTier(HostRamTier):
    """A RAM tier that takes `delay` seconds per layer (to test hit accounting)."""

    def __init__(self, blobs, delay):
        super().__init__(blobs)
        self.delay = delay

    def source(self, layer, staging):
        time.sleep(self.delay)
        return super().source(layer, staging)


def _toy_streamer(delay: float):
    from kvboost_engine.weights.awq.kernels import DequantLayout
    from kvboost_engine.weights.awq.linear import AWQLinear
    from kvboost_tools.awq.grid import quantize_groups

    layers = [torch.nn.Sequential(AWQLinear(64, 16, 32, DequantLayout(), False)) for _ in range(3)]
    bindings = {i: LayerBinding(awq_modules(layer)) for i, layer in enumerate(layers)}
    weights = [torch.randn(16, 64) for _ in layers]
    blobs = {i: bindings[i].pack([DequantLayout().prepare(*quantize_groups(weights[i], 32), 32)]) for i in bindings}
    return layers, LayerStreamer(layers, bindings, SlowTier(blobs, delay), 2, CPU)


def _compute_longer_than_a_load(streamer, index):
    """Stand-in for compute that outlasts a load: wait until layer `index`'s prefetch, if issued, ended."""
    inflight = streamer._inflight.get(index)
    if inflight is not None:
        inflight[1].result(timeout=30)


def test_prefetch_hits_when_compute_hides_loads():
    layers, streamer = _toy_streamer(delay=0.001)
    x = torch.randn(1, 64)
    for _ in range(4):
        for index, layer in enumerate(layers):
            _compute_longer_than_a_load(streamer, index)
            layer(x)
    streamer.reset_stats()
    for index, layer in enumerate(layers):
        _compute_longer_than_a_load(streamer, index)
        layer(x)
    assert streamer.stats.hits == 3 and streamer.stats.waits == 0
    streamer.close()


def test_prefetch_misses_when_loads_are_slow():
    layers, streamer = _toy_streamer(delay=0.03)
    x = torch.randn(1, 64)
    for _ in range(2):
        for layer in layers:
            layer(x)
    assert streamer.stats.waits >= 1 and streamer.stats.wait_s > 0.02     # (a paused main thread hides some)
    streamer.close()
