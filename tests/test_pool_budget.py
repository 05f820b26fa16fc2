"""Cached chunks never wedge the pool: a request that fits an idle pool is never refused.

A property test drives random request mixes (chats that grow, replies stored, documents,
repeats, pins) against small pools, at the cache level with fake KV and at the engine level
with a tiny model, and after every step checks the invariant and that an idle engine serves a
request that fits its pool alone.
"""
import logging
import random

import pytest
import torch

from kvboost_engine import Engine
from kvboost_engine.kv.cache import ChunkCache
from kvboost_engine.kv.pool import BlockPool
from test_cache import BLOCK, BYTES_PER_TOKEN, GEOMETRY, insert
from tiny_models import tiny_model

WORDS = "tea sun rain cat dog map key sea sky owl fox elm".split()
BLOCK_BYTES = 16 * 2 * 2 * 2 * 16 * 4           # 16 tokens x layers x k/v x kv_heads x head_dim x fp32


def test_reply_sharing_its_only_block_with_the_prompt_is_evicted_on_the_way():
    """The wedge of the issue: a stored reply shares its block with the prompt's last chunk; the
    reply frees nothing alone, but evicting it lets the prompt's chunk go and free the block."""
    pool = BlockPool(GEOMETRY, 4 * BLOCK * BYTES_PER_TOKEN, "cpu", block_tokens=BLOCK)
    cache = ChunkCache(b"fp" * 8, 4 * BLOCK * BYTES_PER_TOKEN, pool)
    prompt = list(range(1, 4 * BLOCK - 2))
    insert(cache, prompt + [90, 91], [len(prompt), len(prompt) + 2])      # the reply ends inside the last block
    assert pool.free_blocks() == 0
    cache.make_room(4)                                  # a new, unrelated request needs the whole pool
    assert pool.free_blocks() == 4


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoTokenizer
    from kvboost_engine.loading import default_model_dir
    return tiny_model("llama", max_position_embeddings=512), AutoTokenizer.from_pretrained(default_model_dir())


def test_engine_with_a_pool_of_14_blocks_keeps_answering(tiny):
    """The issue's reproduction: kv_pool_bytes of 14 blocks with the default cache_bytes."""
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, kv_pool_bytes=14 * 16 * 2 * 2 * 2 * 16 * 4)
    cold = Engine(model, tokenizer, cache_bytes=0, kv_pool_bytes=14 * 16 * 2 * 2 * 2 * 16 * 4)
    assert engine.cache.budget_bytes == engine.cache.pool.ram_blocks * engine.cache.pool.block_bytes
    rng = random.Random(0)
    messages = [{"role": "system", "content": "You are terse."}]
    for turn in range(12):
        messages.append({"role": "user", "content": " ".join(rng.choice(["tea", "sun", "rain", "cat"])
                                                               for _ in range(rng.randrange(2, 12)))})
        reply = engine.chat(messages, max_new_tokens=8)
        assert reply.token_ids == cold.chat(messages, max_new_tokens=8).token_ids
        messages.append({"role": "assistant", "content": reply.text})
        if engine.count_tokens(messages) > 150:
            messages = messages[:1]
        engine.cache.check_invariants()
        assert engine.cache.pool.usage()["in_use"] == 0


def test_cache_bytes_larger_than_the_pool_is_clamped_with_a_warning(tiny, caplog):
    model, tokenizer = tiny
    with caplog.at_level(logging.WARNING, logger="kvboost_engine.wiring"):
        engine = Engine(model, tokenizer, cache_bytes=2**30, kv_pool_bytes=2**20)
    assert engine.cache.budget_bytes <= 2**20
    assert "larger than the KV pool" in caplog.text
    assert engine.generate("Hello there", max_new_tokens=2).completion_tokens == 2


def _request(rng, engine, pool_tokens, system, documents):
    """A random request that fits the pool alone: a chat turn, documents in some order, a plain prompt."""
    kind = rng.choice(["chat", "documents", "plain", "stream"])
    words = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))
    if kind == "plain":
        return kind, words(rng.randrange(3, 40))
    messages = [{"role": "system", "content": system}]
    if kind == "documents":
        parts = [{"type": "document", "text": d} for d in rng.sample(documents, rng.randrange(1, 4))]
        messages.append({"role": "user", "content": parts + [{"type": "text", "text": words(4)}]})
    else:
        for _ in range(rng.randrange(1, 4)):
            messages += [{"role": "user", "content": words(rng.randrange(2, 9))},
                         {"role": "assistant", "content": words(rng.randrange(1, 6))}]
        messages.append({"role": "user", "content": words(3)})
    while engine.count_tokens(messages) + 8 > pool_tokens and len(messages) > 2:
        del messages[1:3]
    return kind, messages


@pytest.mark.parametrize("seed", range(4))
def test_random_mixes_never_refuse_a_request_that_fits_the_idle_pool(tiny, seed):
    model, tokenizer = tiny
    rng = random.Random(seed)
    pool_blocks = rng.choice([8, 11, 14])
    engine = Engine(model, tokenizer, kv_pool_bytes=pool_blocks * BLOCK_BYTES,
                    moved_reuse=rng.choice(["blend", "full", "none"]))
    system = " ".join(rng.choice(WORDS) for _ in range(rng.choice([3, 20, 40])))
    documents = [" ".join(rng.choice(WORDS) for _ in range(rng.randrange(8, 30))) for _ in range(5)]
    for _ in range(60):
        kind, request = _request(rng, engine, pool_blocks * 16, system, documents)
        if kind == "plain":
            engine.generate(request, max_new_tokens=rng.randrange(1, 8))     # never refused
        elif kind == "stream":
            stream = engine.stream_chat(request, max_new_tokens=8)
            next(stream, None)
            stream.close()                                                  # left early
        else:
            engine.chat(request, max_new_tokens=rng.randrange(1, 8))
        engine.cache.check_invariants()
        assert engine.cache.pool.usage()["in_use"] == 0                     # nothing leaked


def test_make_room_frees_ram_behind_a_cached_chunk_in_the_spill_file(tmp_path):
    """A cached chain whose parent holds RAM blocks and whose leaf only spill-file blocks: the RAM pass
    counted the parent as freeable, found no leaf freeing RAM (the parent is no leaf) and gave up, so a
    request the pool could serve was refused."""
    from kvboost_engine.kv.budget import CacheBudget
    from kvboost_engine.kv.geometry import KVGeometry
    from kvboost_engine.kv.radix import RadixTree

    class NoIndex:
        def remove(self, node):
            pass

    g = KVGeometry(1, 1, 8, torch.float32)
    block = 16 * g.bytes_per_token
    pool = BlockPool(g, 4 * block, "cpu", block_tokens=16, spill_dir=str(tmp_path), spill_bytes=4 * block)
    tree = RadixTree(b"fp", pool, NoIndex())
    budget = CacheBudget(tree, 10 ** 9)
    blocks = pool.allocate(8)                                     # RAM 0-3, spill file 4-7
    parent = tree.add(tree.root, b"a", tuple(range(64)), blocks[:4], 0, True)
    tree.add(parent, b"b", tuple(range(64, 128)), blocks[4:], 4, True)
    pool.release(blocks)
    budget.make_room(3)
    assert pool.free_ram_blocks() >= 3 and budget.stats.evictions == 2
    assert pool.allocate(3) == [0, 1, 2]
