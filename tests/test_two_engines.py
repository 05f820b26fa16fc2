"""Several engines in one process: loaded from several threads at once, decoding at once."""
from __future__ import annotations

import threading

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedModel

from kvboost_engine import Engine
from kvboost_engine.loading import default_model_dir

from tiny_models import tiny_model

PROMPTS = ("Write a short sentence about the sea.", "Name three colours.")


def at_once(jobs: list) -> list:
    """Run each job on its own thread, all released together; their results (or the exception raised)."""
    out: list = [None] * len(jobs)
    start = threading.Barrier(len(jobs))

    def one(i: int) -> None:
        start.wait()
        try:
            out[i] = jobs[i]()
        except Exception as err:  # noqa: BLE001 - reported by the test
            out[i] = err

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    """A tiny Llama with its head tied to the embedding (what a racing load left on the meta device)."""
    path = tmp_path_factory.mktemp("tied")
    tiny_model("llama", seed=5, tie_word_embeddings=True).save_pretrained(path)
    AutoTokenizer.from_pretrained(default_model_dir()).save_pretrained(path)
    return path


def greedy_ids(engine: Engine) -> list[int]:
    return engine.generate("The river", max_new_tokens=6, min_new_tokens=6).token_ids


def test_engines_load_from_several_threads_at_once(tied_dir):
    # transformers swaps process-wide state while it builds a model; overlapping builds used to
    # leave it swapped (every later load failed). Several rounds: the overlap is a matter of timing.
    tie_weights, dtype = PreTrainedModel.tie_weights, torch.get_default_dtype()
    reference = Engine.from_pretrained(tied_dir, cache_bytes=0)
    expected = greedy_ids(reference)
    reference.close()
    for _ in range(3):
        engines = at_once([lambda: Engine.from_pretrained(tied_dir, cache_bytes=0)] * 2)
        assert [e for e in engines if not isinstance(e, Engine)] == []
        assert [greedy_ids(e) for e in engines] == [expected, expected]
        for engine in engines:
            engine.close()
    assert PreTrainedModel.tie_weights is tie_weights and torch.get_default_dtype() == dtype
    with Engine.from_pretrained(tied_dir, cache_bytes=0) as later:
        assert greedy_ids(later) == expected


def test_a_failed_load_leaves_the_process_able_to_load(tied_dir, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (broken / name).write_bytes((tied_dir / name).read_bytes())
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    tie_weights, dtype = PreTrainedModel.tie_weights, torch.get_default_dtype()
    results = at_once([lambda: Engine.from_pretrained(broken, cache_bytes=0),
                       lambda: Engine.from_pretrained(tied_dir, cache_bytes=0)])
    assert not isinstance(results[0], Engine) and isinstance(results[1], Engine)
    assert PreTrainedModel.tie_weights is tie_weights and torch.get_default_dtype() == dtype
    with results[1] as loaded, Engine.from_pretrained(tied_dir, cache_bytes=0) as later:
        assert greedy_ids(later) == greedy_ids(loaded)


@pytest.mark.parametrize("native_decode", [None, False], ids=["default", "pytorch"])
def test_two_engines_decoding_at_once_reply_as_alone(smol, native_decode):
    model, tokenizer = smol
    engines = [Engine(model, tokenizer, cache_bytes=0, native_decode=native_decode) for _ in PROMPTS]
    try:
        runs = [lambda e=e, p=p: e.generate(p, max_new_tokens=16, min_new_tokens=16).token_ids
                for e, p in zip(engines, PROMPTS)]
        alone = [run() for run in runs]
        together = at_once(runs)
        assert together == alone
    finally:
        for engine in engines:
            engine.close()
