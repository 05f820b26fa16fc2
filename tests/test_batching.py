"""Continuous batching: concurrent requests share forwards and give what each gives alone."""
import threading

import pytest
import torch
from holds import Hold

from kvboost_engine import BudgetError, Engine, FirstTokenEvent, ForwardEvent

SYSTEM = ("You are a careful assistant for a hardware store. Answer in one short sentence. "
          "The store opens at nine, closes at six, and sells tools, paint and garden supplies.")
QUESTIONS = ["When do you open?", "Do you sell paint?", "What is sold here?", "When do you close?",
             "Can I buy a hammer?", "Is there garden soil?"]


def chat(question):
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def concurrent(engine, requests, **params):
    """Start every request, then read them all: they run in shared forwards."""
    events = []
    with engine.instruments.subscribe(events.append):
        streams = [engine.stream_chat(chat(q), **params, **extra) for q, extra in requests]
        gens = [stream.collect() for stream in streams]
    batched = [e for e in events if isinstance(e, ForwardEvent) and e.sequences > 1]
    return gens, batched


@pytest.fixture(scope="module")
def serial(smol):
    """Each request alone, on an engine of its own (no reuse between them)."""
    out = {}
    for q in QUESTIONS:
        engine = Engine(*smol, cache_bytes=0)
        out[q] = engine.chat(chat(q), max_new_tokens=12).token_ids
        engine.close()
    return out


def test_greedy_requests_batched_give_the_tokens_each_gives_alone(smol, serial):
    engine = Engine(*smol)
    gens, batched = concurrent(engine, [(q, {}) for q in QUESTIONS], max_new_tokens=12)
    assert batched and max(e.sequences for e in batched) >= 3      # they really shared forwards
    assert [g.token_ids for g in gens] == [serial[q] for q in QUESTIONS]
    assert engine.cache.pool.usage()["in_use"] == 0
    engine.cache.check_invariants()


def test_each_sequence_samples_with_its_own_settings(smol):
    engine = Engine(*smol, cache_bytes=0)
    requests = [(QUESTIONS[0], {"temperature": 0.9, "seed": 7}), (QUESTIONS[1], {"temperature": 0.0}),
                (QUESTIONS[2], {"temperature": 1.2, "top_p": 0.8, "seed": 3}), (QUESTIONS[3], {"stop": ["."]})]
    alone = [engine.chat(chat(q), max_new_tokens=10, **extra) for q, extra in requests]
    gens, batched = concurrent(engine, requests, max_new_tokens=10)
    assert batched
    assert [g.token_ids for g in gens] == [g.token_ids for g in alone]
    assert [g.text for g in gens] == [g.text for g in alone]


def test_cancelling_one_sequence_mid_batch_leaves_the_others_unchanged_and_frees_its_blocks(smol, serial):
    engine = Engine(*smol, cache_bytes=0)
    hold = Hold(at=2)                                   # stream 1 is certainly mid-decode when cancelled
    streams = [engine.stream_chat(chat(q), max_new_tokens=12, constraint=hold if i == 1 else None)
               for i, q in enumerate(QUESTIONS[:3])]
    try:
        assert hold.reached.wait(60)
        streams[1].cancel()
    finally:
        hold.release.set()
    assert streams[1].collect().finish_reason == "cancelled"
    others = [streams[0].collect(), streams[2].collect()]
    assert [g.token_ids for g in others] == [serial[QUESTIONS[0]], serial[QUESTIONS[2]]]
    assert engine.cache.pool.usage()["in_use"] == 0
    assert engine.chat(chat(QUESTIONS[1]), max_new_tokens=12).token_ids == serial[QUESTIONS[1]]


def test_a_flood_beyond_the_budget_queues_then_gets_a_clear_error_and_the_engine_stays_usable(smol, serial):
    per_token = 46080
    engine = Engine(*smol, cache_bytes=0, kv_pool_bytes=160 * per_token, max_waiting=3, queue_timeout_s=0.5)
    results: list = []

    def one(q):
        try:
            results.append(engine.chat(chat(q), max_new_tokens=40, min_new_tokens=40))
        except BudgetError as err:
            results.append(err)

    threads = [threading.Thread(target=one, args=(QUESTIONS[i % len(QUESTIONS)],)) for i in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    errors = [r for r in results if isinstance(r, BudgetError)]
    done = [r for r in results if not isinstance(r, BudgetError)]
    assert len(results) == 12 and done and errors
    assert all("max_waiting" in str(e) or "waited" in str(e) for e in errors), errors
    assert all(g.completion_tokens == 40 for g in done)
    assert engine.cache.pool.usage()["in_use"] == 0
    engine.cache.check_invariants()
    assert engine.chat(chat(QUESTIONS[0]), max_new_tokens=12).token_ids == serial[QUESTIONS[0]]


def test_a_short_request_is_not_held_behind_a_long_prefill(smol):
    engine = Engine(*smol, cache_bytes=0, prefill_chunk_tokens=64)
    long_prompt = " ".join(f"Item {i} costs {i % 13} dollars." for i in range(120))      # ~1000 tokens
    events = []
    with engine.instruments.subscribe(events.append):
        long = engine.stream(long_prompt, max_new_tokens=2)
        short = engine.stream("Hi", max_new_tokens=2)
        short_gen, long_gen = short.collect(), long.collect()
    forwards = [e for e in events if isinstance(e, ForwardEvent)]
    firsts = [e.prompt_tokens for e in events if isinstance(e, FirstTokenEvent)]
    assert firsts == [short_gen.prompt_tokens, long_gen.prompt_tokens]    # the short one answered first
    assert any(e.sequences > 1 for e in forwards)               # riding along a chunk of the long one
    assert all(e.tokens <= 64 for e in forwards)                # no forward took the whole long prompt


def test_a_chat_continuing_a_prompt_being_prefilled_maps_its_blocks(smol):
    engine = Engine(*smol, cache_bytes=2**26, prefill_chunk_tokens=32)
    streams = [engine.stream_chat(chat(q), max_new_tokens=4) for q in QUESTIONS[:4]]
    gens = [s.collect() for s in streams]
    assert sum(g.reused_exact > 0 for g in gens) >= 2           # later ones waited and mapped the first's blocks


def test_langchain_batch_and_abatch_share_forwards_with_no_code_change(smol, serial):
    import asyncio

    from langchain_core.messages import HumanMessage, SystemMessage

    from kvboost_integrations.langchain import ChatKVBoost
    engine = Engine(*smol)
    llm = ChatKVBoost(engine=engine, max_tokens=12)
    inputs = [[SystemMessage(SYSTEM), HumanMessage(q)] for q in QUESTIONS[:4]]
    for run in (lambda: llm.batch(inputs, config={"max_concurrency": 4}), lambda: asyncio.run(llm.abatch(inputs))):
        events = []
        with engine.instruments.subscribe(events.append):
            replies = run()
        assert any(isinstance(e, ForwardEvent) and e.sequences > 1 for e in events)
        expected = [engine.tokenizer.decode(serial[q], skip_special_tokens=True) for q in QUESTIONS[:4]]
        assert [r.content for r in replies] == expected


def test_an_engine_built_and_used_inside_inference_mode_works(smol, serial):
    import torch
    with torch.inference_mode():                 # the pool is an inference tensor; the scheduler thread copes
        engine = Engine(*smol)
        engine.warm(chat(QUESTIONS[0])[:1])
        gens, _ = concurrent(engine, [(q, {}) for q in QUESTIONS[:2]], max_new_tokens=12)
    assert [g.token_ids for g in gens] == [serial[q] for q in QUESTIONS[:2]]


def test_decoding_sequences_over_one_prompt_read_its_shared_blocks_once(smol, serial, monkeypatch):
    """Chats over one system prompt attend over its shared pool blocks in one call per layer
    (cascade attention), and still give the tokens each gives alone."""
    from kvboost_engine.kv.paged import PagedSequence
    groups = []
    original = PagedSequence.attend_shared

    def counted(self, seqs, ends, layer, *args):
        groups.append((len(seqs), args[-2]))                            # (..., shared, scratch)
        return original(self, seqs, ends, layer, *args)

    monkeypatch.setattr(PagedSequence, "attend_shared", counted)
    engine = Engine(*smol, native_decode=False)           # the PyTorch batch step (native: one step over all rows)
    engine.chat(chat(QUESTIONS[0]), max_new_tokens=1)                  # the system prompt is cached
    gens, _ = concurrent(engine, [(q, {}) for q in QUESTIONS], max_new_tokens=12)
    assert groups and max(n for n, _ in groups) >= 3 and min(s for _, s in groups) >= 32
    assert [g.token_ids for g in gens] == [serial[q] for q in QUESTIONS]
    engine.close()


@pytest.mark.parametrize("rows", [1, 4, 8, 11, 15, 16])
def test_logits_of_several_rows_equal_each_row_alone(rows):
    """The lm_head of 8-15 rows runs padded to 16 (a faster GEMM path): same logits, same shape."""
    from kvboost_engine.model.arch import LM_HEAD_SLOW_ROWS, ModelAdapter
    from tiny_models import tiny_model
    adapter = ModelAdapter(tiny_model("llama"))
    assert adapter._pad_head_rows and LM_HEAD_SLOW_ROWS == (8, 16)
    hidden = torch.randn(1, 20, adapter.config.hidden_size)
    picked = list(range(2, 2 + rows))
    together = adapter.logits_at(hidden, picked)
    assert together.shape == (rows, adapter.config.vocab_size) and together.dtype == torch.float32
    alone = torch.stack([adapter.logits_at(hidden, [r])[0] for r in picked])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)
