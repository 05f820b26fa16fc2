"""A short soak (benchmarks/micro/soak.py) on a tiny model: mixed requests from several threads
against a 40-block pool and a disk tier run batched on the scheduler, never refuse a request that
fits the pool (it waits for room instead), leak no block, and leave an engine that answers like a
cache_bytes=0 one."""
from __future__ import annotations

from transformers import AutoTokenizer

from benchmarks.micro.soak import KINDS, run_soak, summary
from kvboost_engine import Engine
from kvboost_engine.loading import default_model_dir
from tiny_models import tiny_model


def test_a_short_soak_refuses_nothing_that_fits_and_leaks_nothing(tmp_path):
    model, tokenizer = tiny_model("llama", max_position_embeddings=1024), AutoTokenizer.from_pretrained(default_model_dir())
    block_bytes = 16 * 2 * 2 * 2 * 16 * 4                 # 16 tokens x layers x k/v x kv_heads x head_dim x fp32
    engine = Engine(model, tokenizer, kv_pool_bytes=40 * block_bytes, cache_bytes=40 * block_bytes,
                    disk_cache_dir=str(tmp_path), moved_reuse="blend")     # blend: the content index is used
    soak = run_soak(engine, requests=48, threads=4, seed=1, every=16)
    found = summary(soak, Engine(model, tokenizer, cache_bytes=0))
    assert found["requests"] == 48 and sum(found["kinds"].values()) == 48 and set(found["kinds"]) == set(KINDS)
    assert found["errors"] == 0, found["first_errors"]
    assert found["refusals_fitting_pool"] == 0 and found["leaked_blocks"] == 0
    assert found["probe_equals_no_cache"]
    assert found["batching"]["forwards"] > 0 and found["batching"]["max_sequences"] >= 2   # requests shared forwards
    assert 0 < found["ttft_s"]["p50"] <= found["ttft_s"]["max"]
    assert [s["requests"] for s in found["samples"]] == [16, 32, 48]
    assert found["content_entries"]["max"] >= found["content_entries"]["last"] >= 0
    assert found["content_entries"]["max"] > 0                    # the documents were indexed (moved_reuse="blend")


def test_a_short_chaos_soak_ends_every_request_and_leaks_nothing(tmp_path):
    """benchmarks/micro/chaos.py in small: scheduler faults at 5 % per seam call and a flaky remote
    replica; every request ends (a result or a clear error), none hangs, no block leaks."""
    from benchmarks.micro.chaos import run_chaos
    model, tokenizer = tiny_model("llama", max_position_embeddings=1024), AutoTokenizer.from_pretrained(default_model_dir())
    block_bytes = 16 * 2 * 2 * 2 * 16 * 4
    engine = Engine(model, tokenizer, kv_pool_bytes=40 * block_bytes, cache_bytes=40 * block_bytes,
                    disk_cache_dir=str(tmp_path))
    found = run_chaos(engine, 60, 4, fault_rate=0.05, remote_share=0.3, replica_fault_rate=0.5, seed=2, every=20)
    assert found["lost"] == 0 and found["hangs"] == 0 and found["other_errors"] == 0, found["examples"]
    assert sum(found["outcomes"].values()) == 60 and found["leaked_blocks"] == 0
    assert found["outcomes"].get("injected_error", 0) > 0 and sum(found["injected"].values()) > 0
    assert found["outcomes"].get("remote_ok", 0) > 0 and sum(found["remote"]["flaky_faults"].values()) > 0
    assert engine.chat([{"role": "user", "content": "Hi"}], max_new_tokens=3).completion_tokens >= 1
    engine.close()
