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


# Standard-suite tests whose inputs the 135M default model cannot follow (each with the reason);
# marked here because the suite parametrizes them itself.
_SMALL_MODEL_LIMITS = {
    ("test_langchain_standard.py", "test_structured_output[pydantic]"),
    ("test_langchain_standard.py", "test_structured_output_async[pydantic]"),
    ("test_langchain_standard.py", "test_structured_output_pydantic_2_v1"),
    ("test_langchain_standard.py", "test_structured_output[typeddict]"),
    ("test_langchain_standard.py", "test_structured_output[json_schema]"),
    ("test_langchain_standard.py", "test_structured_output_async[typeddict]"),
    ("test_langchain_standard.py", "test_structured_output_async[json_schema]"),
    ("test_langchain_standard.py", "test_structured_output_optional_param"),
}
_RAMBLES = ("SmolLM2-135M-Instruct (135M parameters) repeats itself inside the joke's first string field "
            "until max_tokens cuts the JSON (finish_reason 'length'; the output follows the schema up to the "
            "cut), and a cut structured reply raises LengthCutError, never a partial object (before that, the "
            "dict parsers returned the partial object and their tests passed)")


def pytest_collection_modifyitems(items):
    for item in items:
        if (item.path.name, item.name) in _SMALL_MODEL_LIMITS and "Integration" in item.nodeid:
            item.add_marker(pytest.mark.xfail(reason=_RAMBLES, strict=False))
