"""Shared fixtures: the real default model (loaded once) and tiny random models."""
from __future__ import annotations

import os

import pytest
import torch

from kvboost_engine import Engine
from kvboost_engine.loading import default_model_dir, load_model_and_tokenizer

# KVBOOST_TEST_THREADS=1 keeps the suite usable on a machine busy with other work (spinning threads)
torch.set_num_threads(int(os.environ.get("KVBOOST_TEST_THREADS", min(2, os.cpu_count() or 1))))


@pytest.fixture(scope="session")
def smol():
    """(model, tokenizer) of the default SmolLM2-135M-Instruct, fp32 on CPU."""
    model, tokenizer = load_model_and_tokenizer(default_model_dir(), device=torch.device("cpu"), dtype=torch.float32)
    return model, tokenizer


@pytest.fixture
def engine(smol):
    model, tokenizer = smol
    return Engine(model, tokenizer, cache_bytes=512 * 2**20)


@pytest.fixture
def cold_engine(smol):
    model, tokenizer = smol
    return Engine(model, tokenizer, cache_bytes=0)


@pytest.fixture
def moved_engine(smol):
    """An engine with approximate moved reuse turned on (opt-in): documents found at other positions are reused."""
    model, tokenizer = smol
    return Engine(model, tokenizer, cache_bytes=512 * 2**20, moved_reuse="blend")
