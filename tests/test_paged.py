"""Paged KV: identical output to the contiguous path, shared blocks, hard budgets, disk tier, spill."""
import errno
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from kvboost_engine import BudgetError, Engine, KVBoostError
from test_engine_exact import QUESTIONS, SYSTEM
from tiny_models import tiny_model

ROOT = Path(__file__).resolve().parent.parent


def chat_replay(engine, turns=8, max_new_tokens=16):
    messages = [{"role": "system", "content": SYSTEM}]
    replies = []
    for question in QUESTIONS[:turns]:
        messages.append({"role": "user", "content": question})
        g = engine.chat(messages, max_new_tokens=max_new_tokens)
        replies.append(g.token_ids)
        messages.append({"role": "assistant", "content": g.text})
    return replies


def test_paged_chat_is_token_identical_to_contiguous(smol):
    model, tokenizer = smol
    paged = Engine(model, tokenizer, paged=True)
    contiguous = Engine(model, tokenizer, paged=False)
    assert chat_replay(paged) == chat_replay(contiguous)
    paged.cache.check_invariants()


def test_paged_chat_attending_run_by_run_is_token_identical(smol, monkeypatch):
    """Short sequences over several block runs gather the runs into one buffer; long ones attend
    each run in place and merge by log-sum-exp. Force the second path on the chat replay."""
    import kvboost_engine.kv.paged as paged_module
    model, tokenizer = smol
    contiguous = chat_replay(Engine(model, tokenizer, paged=False), turns=4)
    monkeypatch.setattr(paged_module, "GATHER_MAX_KEYS", 0)
    engine = Engine(model, tokenizer, paged=True)
    assert chat_replay(engine, turns=4) == contiguous
    assert engine.stats()["reused_tokens"] > 0


def test_paged_long_prompt_is_token_identical_to_contiguous(smol):
    model, tokenizer = smol
    text = " ".join(f"Line {i}: the value of item {i} is {i * 7 % 97}." for i in range(330))
    paged = Engine(model, tokenizer, paged=True, cache_bytes=0)
    contiguous = Engine(model, tokenizer, paged=False, cache_bytes=0)
    a = paged.generate(text + "\nThe value of item 12 is", max_new_tokens=6)
    assert a.prompt_tokens >= 4000
    assert a.token_ids == contiguous.generate(text + "\nThe value of item 12 is", max_new_tokens=6).token_ids


def test_concurrent_chats_share_the_system_prompt_blocks(smol):
    model, tokenizer = smol
    engine = Engine(model, tokenizer)
    system = [{"role": "system", "content": SYSTEM}]
    engine.warm(system)
    prompt_blocks = engine.stats()["pool_blocks_used"]
    streams = [engine.stream_chat(system + [{"role": "user", "content": f"Question {i}?"}], max_new_tokens=8)
               for i in range(4)]
    for stream in streams:
        next(stream)                                      # every stream has its KV in place now
    used = engine.stats()["pool_blocks_used"]
    per_chat = -(-(8 + 30) // 16) + 1                     # own blocks: new tokens, reply, one copied block
    assert used <= prompt_blocks + 4 * per_chat, (used, prompt_blocks)
    assert used < 2 * prompt_blocks + 4                   # the prompt's blocks are there once, not 4 times
    for stream in streams:
        stream.collect()
    engine.cache.check_invariants()


def test_request_that_fits_only_alone_waits_for_room_or_is_refused_after_the_queue_timeout(smol):
    model, tokenizer = smol
    per_token = 46080
    long_story = "Tell me a long story about a dragon. " * 40
    for timeout in (300.0, 0.0):
        engine = Engine(model, tokenizer, cache_bytes=0, kv_pool_bytes=700 * per_token, queue_timeout_s=timeout)
        running = engine.stream(long_story, max_new_tokens=40)
        first = next(running)
        if timeout:
            later = engine.generate("Another long request. " * 80, max_new_tokens=8)   # waits, then runs
            assert later.completion_tokens >= 1
        else:
            with pytest.raises(BudgetError, match="needs.*waited"):
                engine.generate("Another long request. " * 80, max_new_tokens=8)
        rest = running.collect()
        assert first and rest.completion_tokens == 40 or rest.finish_reason == "stop"
        assert engine.stats()["pool_blocks_used"] == 0
        assert engine.generate("Short.", max_new_tokens=2).completion_tokens >= 1
        with pytest.raises(BudgetError, match="refused before any work"):
            engine.generate("Far too long. " * 400, max_new_tokens=8)                 # never fits: at once
        engine.close()


def test_spill_runs_a_context_longer_than_the_pool_only_with_the_disk_tier(smol, tmp_path):
    tokenizer = smol[1]
    model = tiny_model("llama", max_position_embeddings=16384)
    geometry_bytes = 2 * 2 * 2 * 16 * 4                  # layers * k/v * kv_heads * head_dim * fp32
    prompt = "Numbers: " + " ".join(str(i) for i in range(3000))
    reference = Engine(model, tokenizer, cache_bytes=0, paged=False).generate(prompt, max_new_tokens=5,
                                                                              min_new_tokens=5)
    small = dict(cache_bytes=0, kv_pool_bytes=1024 * geometry_bytes)
    with pytest.raises(BudgetError, match="needs"):
        Engine(model, tokenizer, **small).generate(prompt, max_new_tokens=5)
    spilled = Engine(model, tokenizer, disk_cache_dir=str(tmp_path), **small)
    out = spilled.generate(prompt, max_new_tokens=5, min_new_tokens=5)
    assert out.prompt_tokens > 4 * 1024
    assert out.token_ids == reference.token_ids
    assert spilled.stats()["pool_peak_blocks_used"] > spilled.stats()["pool_ram_blocks"]
    pool = spilled.cache.pool                            # the spill file got its disk space before its first write
    fd = pool._spill_fd
    assert os.fstat(fd).st_blocks * 512 >= pool.spill.numel() * pool.spill.element_size()
    spilled.close()                                      # close() gives the file, its space and the pool back
    with pytest.raises(OSError):                         # (they stayed until the engine was collected)
        os.fstat(fd)
    assert pool.spill is None and pool.ram.numel() == 0
    assert spilled.stats()["pool_ram_blocks"] == 0 and spilled.memory()["pool_bytes"] == 0
    with pytest.raises(KVBoostError, match="closed"):
        spilled.generate(prompt, max_new_tokens=1)


def test_a_request_that_fits_the_pool_alone_runs_next_to_a_split_chunk(smol):
    """A chunk split by a second branch keeps a copy of its first block that eviction cannot reach while a
    request maps the chunk: a request filling the pool exactly was refused (BudgetError) with nothing else
    running, and ran with the cache off. The match is given back and the prompt computed whole."""
    tokenizer = smol[1]
    model = tiny_model("llama")                          # 512 bytes of KV a token
    pool = 9 * 16 * 512                                  # 9 blocks of 16: exactly 144 positions
    head, words = "the cat sat on", (" far away into deep green forests near old towns and" * 20).split()

    def prompt(n_tokens):
        k = next(k for k in range(1, len(words)) if len(tokenizer(head + " " + " ".join(words[:k]))["input_ids"]) >= n_tokens)
        return head + " " + " ".join(words[:k])

    first, long = prompt(64), prompt(134)
    room = 144 - len(tokenizer(long)["input_ids"])
    replies = []
    for cache in (0, pool):
        engine = Engine(model, tokenizer, cache_bytes=cache, kv_pool_bytes=pool)
        engine.generate(first, max_new_tokens=1)
        engine.generate(head + " a mat while the dogs ran", max_new_tokens=1)      # splits the first chunk
        before = engine.stats()
        out = engine.generate(long, max_new_tokens=room, min_new_tokens=room)
        replies.append(out.token_ids)
        after = engine.stats()                           # the match given back counts as the miss it became
        assert out.reused_tokens == 0 and after["hit_tokens"] == before["hit_tokens"]
        assert engine.cache.pool.usage()["in_use"] == 0
        engine.cache.check_invariants()
    assert replies[0] == replies[1]


def test_a_spill_file_the_disk_cannot_hold_refuses_the_request_not_the_process(smol, tmp_path, monkeypatch):
    tokenizer = smol[1]
    model = tiny_model("llama", max_position_embeddings=16384)
    geometry_bytes = 2 * 2 * 2 * 16 * 4
    engine = Engine(model, tokenizer, disk_cache_dir=str(tmp_path), cache_bytes=0, kv_pool_bytes=1024 * geometry_bytes)

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)     # a full disk: the first write to the mapping would SIGBUS
    with pytest.raises(BudgetError, match="spill file cannot get"):
        engine.generate("Numbers: " + " ".join(str(i) for i in range(3000)), max_new_tokens=2)
    assert engine.cache.pool.used_blocks() == 0          # nothing held by the refused request
    assert engine.generate("Short.", max_new_tokens=2).completion_tokens >= 1
    engine.close()


def test_a_request_that_fits_in_ram_evicts_cached_chunks_before_it_spills(smol, tmp_path, monkeypatch):
    """With a disk tier, the spill file's blocks counted as free: a request that fits the RAM pool once
    cached chunks go was put in the spill file whole (every step on the PyTorch loop, 11x slower in a
    review), and refused where the disk could not hold the spill file."""
    tokenizer = smol[1]
    model = tiny_model("llama")                          # 512 bytes of KV a token: 8 KiB a block of 16
    block = 16 * 512
    words = "far away into deep green forests near old towns and rivers".split()
    first = "Story one. " + " ".join(words[i % len(words)] for i in range(210))
    second = "Story two. " + " ".join(words[(3 * i) % len(words)] for i in range(180))
    want = Engine(model, tokenizer, cache_bytes=0).generate(second, max_new_tokens=16, min_new_tokens=16).token_ids

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)     # the spill file never gets its space
    engine = Engine(model, tokenizer, disk_cache_dir=str(tmp_path), cache_bytes=16 * block, kv_pool_bytes=24 * block)
    engine.generate(first, max_new_tokens=1)
    assert engine.stats()["bytes_used"] > 10 * block     # cached: fewer RAM blocks free than the second needs
    out = engine.generate(second, max_new_tokens=16, min_new_tokens=16)
    stats = engine.stats()
    assert out.token_ids == want and stats["evictions"] > 0
    assert stats["pool_peak_blocks_used"] <= stats["pool_ram_blocks"]
    assert "KV blocks spilled to disk" not in (stats["native_fallback_steps"] or {})
    engine.close()


RESTART_SCRIPT = """
import sys, json, torch
from kvboost_engine import Engine
from kvboost_engine.loading import default_model_dir, load_model_and_tokenizer
model, tokenizer = load_model_and_tokenizer(default_model_dir(), device=torch.device("cpu"), dtype=torch.float32)
engine = Engine(model, tokenizer, disk_cache_dir=sys.argv[1])
messages = [{"role": "system", "content": sys.argv[2]}, {"role": "user", "content": "Hi"}]
g = engine.chat(messages, max_new_tokens=8)
engine.close()
print(json.dumps({"reused": g.reused_tokens, "prompt": g.prompt_tokens, "ids": g.token_ids,
                  "disk_hits": engine.stats()["disk_restored_chunks"]}))
"""


def run_process(directory, system):
    out = subprocess.run([sys.executable, "-c", RESTART_SCRIPT, str(directory), system], capture_output=True,
                         text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    import json
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_disk_tier_survives_restart_and_corrupt_files_are_never_served(tmp_path):
    system = SYSTEM * 2
    first = run_process(tmp_path, system)
    assert first["reused"] == 0
    second = run_process(tmp_path, system)
    assert second["disk_hits"] > 0 and second["reused"] >= first["prompt"] - 12
    assert second["ids"] == first["ids"]
    for path in tmp_path.rglob("*.kv"):
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF                      # flip bytes in the middle of the payload
        path.write_bytes(bytes(data))
    third = run_process(tmp_path, system)
    assert third["ids"] == first["ids"]
    assert third["reused"] < second["reused"]


def test_kv_device_cpu_option(smol):
    """kv_device="cpu" keeps KV in CPU pages (weights elsewhere; checked on CUDA by
    benchmarks/device/gpu_check.py --checks kv_cpu). On a CPU model it is the default paged path."""
    from kvboost_engine import InputError
    from kvboost_engine.config import EngineConfig
    engine = Engine(*smol, kv_device="cpu", paged=None)
    assert engine.config.paged and engine.cache.pool.ram.device.type == "cpu"
    assert engine.generate("Hello there", max_new_tokens=3).token_ids
    with pytest.raises(InputError, match="kv_device"):
        EngineConfig(kv_device="cuda")
    with pytest.raises(InputError, match="needs paged"):
        EngineConfig(kv_device="cpu", paged=False)
