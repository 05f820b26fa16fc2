"""Gemma 3 (tiny random config, window 16) in batched forwards: sliding-window and global layers,
final logit soft-capping, several sequences in one pass, each the same as when run alone."""
import torch

from kvboost_engine import Engine
from kvboost_engine.instrument import ForwardEvent
from kvboost_engine.kv.contiguous import SequenceKV
from kvboost_engine.model.arch import ModelAdapter
from kvboost_engine.model.forward import Forward
from test_gemma import gemma, tokenizer  # noqa: F401 - the tiny Gemma 3 and the tokenizer fixtures

WINDOW = 16
PROMPTS = [" ".join(f"Lantern {i} on the pier burns {i * 7 % 23} hours." for i in range(6)),
           "Ferry log: " + " ".join(f"crossing {i} carried {i * 11 % 41} carts," for i in range(9))]


def test_batched_forward_equals_each_sequence_alone(gemma, tokenizer):
    """A decode token past the window next to prompt chunks: the logits of each sequence, soft-capped,
    equal its own single-sequence forward's."""
    adapter = ModelAdapter(gemma)
    forward = Forward(adapter)
    a, b = (tokenizer(p)["input_ids"] for p in PROMPTS)
    assert len(a) > 3 * WINDOW and len(b) > 4 * WINDOW

    def fresh():
        return SequenceKV(adapter.geometry, 256, adapter.device)
    alone_a, batched_a, alone_b, batched_b = fresh(), fresh(), fresh(), fresh()
    forward(alone_a, a[:-1], 0)
    forward(batched_a, a[:-1], 0)
    split = 2 * WINDOW + 3
    steps = [[(a[-1:], len(a) - 1), (b[:split], 0)],          # a decodes, b's first chunk
             [(a[:1], len(a)), (b[split:], split)]]           # a decodes again, b's chunk past the window
    for (ids_a, start_a), (ids_b, start_b) in steps:
        together = forward.batch([(batched_a, ids_a, start_a), (batched_b, ids_b, start_b)], [True, True])
        apart = [forward(alone_a, ids_a, start_a), forward(alone_b, ids_b, start_b)]
        for got, want in zip(together, apart):
            assert got.shape == want.shape
            assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
            assert got.abs().max() <= gemma.config.final_logit_softcapping      # soft-capped
    positions = torch.arange(len(a) + 1)
    for layer in range(len(adapter.layers)):
        for got, want in zip(batched_a.gather(layer, positions), alone_a.gather(layer, positions)):
            assert torch.allclose(got, want, atol=1e-5)


def test_batched_generation_of_two_gemma_requests_equals_each_run_alone(gemma, tokenizer):
    """Two requests running at once (decode steps next to the other's prompt chunks, both past the
    window) give the tokens each gives alone."""
    engine = Engine(gemma, tokenizer, cache_bytes=0, prefill_chunk_tokens=WINDOW + 4)
    params = dict(max_new_tokens=2 * WINDOW, min_new_tokens=2 * WINDOW)
    alone = [engine.generate(p, **params).token_ids for p in PROMPTS]
    events: list = []
    runner = engine._parts.prefill.runner
    with engine.instruments.subscribe(events.append):
        with runner.lock:                 # the first request's first forward waits until both are queued
            streams = [engine.stream(p, **params) for p in PROMPTS]
        for stream in streams:
            list(stream)
    batched = [e for e in events if isinstance(e, ForwardEvent) and e.sequences > 1]
    assert len(batched) >= 2 * WINDOW
    assert [s.generation.token_ids for s in streams] == alone
