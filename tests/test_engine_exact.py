"""Exact reuse: the cache must not change a single greedy token, and must reuse what it should."""
import threading

import pytest
import torch

from kvboost_engine import Engine, InputError

SYSTEM = ("You are a concise assistant for a bicycle repair shop. Opening hours are 8 to 18 on weekdays. "
          "A tune-up costs 45 euros, a new chain 25 euros, brake pads 15 euros per wheel. ") * 3
QUESTIONS = ["How much is a tune-up?", "And a chain?", "When do you open on Monday?", "Do you fix brakes?",
             "What do two brake pads cost?", "Are you open on Sunday?", "Can I book online?", "Thanks, bye!"]


def replay(engine, turns=8, max_new_tokens=24):
    messages = [{"role": "system", "content": SYSTEM}]
    results = []
    for question in QUESTIONS[:turns]:
        messages.append({"role": "user", "content": question})
        logits = engine.next_token_logits(messages=messages)
        g = engine.chat(messages, max_new_tokens=max_new_tokens)
        results.append((g, logits, engine.encode_messages(messages)))
        messages.append({"role": "assistant", "content": g.text})
    return results


def new_tail_tokens(prompt):
    """Tokens after the end of the last assistant reply: the new user message and template glue."""
    ends = [end for end, kind in zip(prompt.chunk_ends, prompt.chunk_kinds) if kind == "assistant"]
    return len(prompt) - (ends[-1] if ends else 0)


def test_eight_turn_chat_is_token_identical_with_and_without_cache(engine, cold_engine):
    warm = replay(engine)
    cold = replay(cold_engine)
    for turn, ((gw, lw, prompt), (gc, lc, _)) in enumerate(zip(warm, cold), 1):
        assert gw.token_ids == gc.token_ids, f"turn {turn}"
        assert torch.allclose(lw, lc, atol=1e-4, rtol=0), f"turn {turn}: {(lw - lc).abs().max()}"
        assert gc.reused_tokens == 0
        if turn >= 2:
            assert gw.reused_tokens >= gw.prompt_tokens - (new_tail_tokens(prompt) + 2), f"turn {turn}"
            assert gw.reused_exact == gw.reused_tokens, f"turn {turn}"      # replies' decode KV is exact
    assert engine.stats()["hits"] > 0 and cold_engine.stats()["bytes_used"] == 0
    engine.cache.check_invariants()


def test_greedy_output_matches_transformers_generate(engine, smol):
    model, _ = smol
    messages = [{"role": "user", "content": "Name three colors of the rainbow."}]
    prompt = engine.encode_messages(messages)
    g = engine.chat(messages, max_new_tokens=20)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt.token_ids]), max_new_tokens=20, do_sample=False)
    assert g.token_ids == out[0, len(prompt):].tolist()


def test_partial_chunk_reuse_is_token_exact(engine):
    first = engine.generate("The quick brown fox jumps over the lazy dog near the river bank.", max_new_tokens=2)
    second = engine.generate("The quick brown fox jumps over the lazy cat.", max_new_tokens=2)
    common = 0
    a = engine.encode_prompt("The quick brown fox jumps over the lazy dog near the river bank.").token_ids
    b = engine.encode_prompt("The quick brown fox jumps over the lazy cat.").token_ids
    while a[common] == b[common]:
        common += 1
    assert first.reused_tokens == 0 and second.reused_tokens == common


def test_streaming_deltas_add_up_and_stop_string_is_excluded(engine, cold_engine):
    messages = [{"role": "user", "content": "Count from one to ten in words, separated by commas."}]
    full = cold_engine.chat(messages, max_new_tokens=40)
    stop = full.text[10:16]
    stream = engine.stream_chat(messages, max_new_tokens=40, stop=[stop])
    deltas = list(stream)
    assert "".join(deltas) == stream.generation.text == full.text[:full.text.index(stop)]
    assert stream.generation.finish_reason == "stop"


def test_concurrent_threads_get_their_own_correct_outputs(engine, cold_engine):
    prompts = [[{"role": "user", "content": f"Write a short sentence about the number {n}."}] for n in (3, 7, 11, 42)]
    expected = [cold_engine.chat(p, max_new_tokens=16).token_ids for p in prompts]
    results = [None] * 4

    def work(i):
        for _ in range(2):
            results[i] = engine.chat(prompts[i], max_new_tokens=16).token_ids

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == expected
    engine.cache.check_invariants()


def test_closed_stream_and_exception_leave_cache_consistent(engine, cold_engine, monkeypatch):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "List four bike parts."}]
    stream = engine.stream_chat(messages, max_new_tokens=30)
    next(stream)
    stream.close()
    engine.cache.check_invariants()

    calls = {"n": 0}
    real = engine.adapter.run_layer

    def flaky(layer_idx, *args):
        calls["n"] += 1
        if calls["n"] == 20:                            # in the prefill (decode steps may not call it)
            raise KeyboardInterrupt("simulated interrupt mid-forward")
        return real(layer_idx, *args)

    monkeypatch.setattr(engine.adapter, "run_layer", flaky)
    native_prefill = engine._native.prefill if engine._native is not None else None

    def flaky_prefill(kv, token_ids, start):            # the native prefill runs no layer: half a chunk, then out
        native_prefill(kv, token_ids[:len(token_ids) // 2], start)
        raise KeyboardInterrupt("simulated interrupt mid-prefill")
    if native_prefill is not None:
        monkeypatch.setattr(engine._native, "prefill", flaky_prefill)
    other = messages[:1] + [{"role": "user", "content": "What does a chain cost, and a tune-up?"}]
    with pytest.raises(KeyboardInterrupt):
        engine.chat(other, max_new_tokens=30)
    monkeypatch.setattr(engine.adapter, "run_layer", real)
    if native_prefill is not None:
        monkeypatch.setattr(engine._native, "prefill", native_prefill)
    engine.cache.check_invariants()
    for msgs in (messages, other):
        assert engine.chat(msgs, max_new_tokens=30).token_ids == cold_engine.chat(msgs, max_new_tokens=30).token_ids


def test_small_budget_evicts_but_never_exceeds_and_stays_exact(smol, cold_engine):
    model, tokenizer = smol
    budget = 120 * 46080                                # about 120 tokens of KV
    small = Engine(model, tokenizer, cache_bytes=budget)
    for n in range(4):
        messages = [{"role": "user", "content": f"Tell me one fact about planet number {n + 1}. " * 5}]
        assert small.chat(messages, max_new_tokens=8).token_ids == cold_engine.chat(messages, max_new_tokens=8).token_ids
        assert small.stats()["bytes_used"] <= budget
        small.cache.check_invariants()
    assert small.stats()["evictions"] > 0


def test_a_next_turn_is_the_prompt_a_fresh_engine_tokenizes(smol):
    """A reply whose text tokenizes otherwise than the ids that produced it (a markdown table, often
    on random weights) was sent back as those ids: the next turn's prompt, and its reply, differed
    from a fresh engine's (another process, a restart, another replica) and from transformers'.
    By default a reply's text is tokenized as any engine does; the memo is opt-in."""
    from tiny_models import tiny_model
    tokenizer = smol[1]
    for seed in range(4):
        model = tiny_model("llama", seed=seed)
        engine = Engine(model, tokenizer)
        first = [{"role": "user", "content": "Hi"}]
        reply = engine.chat(first, max_new_tokens=40)
        again = first + [{"role": "assistant", "content": reply.text}, {"role": "user", "content": "ok"}]
        ids = engine.encode_messages(again).token_ids
        text = tokenizer.apply_chat_template(again, tokenize=False, add_generation_prompt=True)
        assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
        fresh = Engine(model, tokenizer, cache_bytes=0)
        assert engine.chat(again, max_new_tokens=12).token_ids == fresh.chat(again, max_new_tokens=12).token_ids
    memo = Engine(model, tokenizer, reply_memo_entries=8)         # opt-in: the reply's own ids
    reply = memo.chat(first, max_new_tokens=40)
    again = first + [{"role": "assistant", "content": reply.text}, {"role": "user", "content": "ok"}]
    assert memo.chat(again, max_new_tokens=2).reused_tokens >= reply.prompt_tokens + len(reply.token_ids) - 1


# Gemma 3's way: the system prompt goes into the first user turn; a system message alone renders nothing
FOLDING_TEMPLATE = ("{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + '\n\n' %}"
                    "{% set rest = messages[1:] %}{% else %}{% set first = '' %}{% set rest = messages %}{% endif %}"
                    "{% for m in rest %}<|im_start|>{{ m['role'] }}\n{% if loop.first %}{{ first }}{% endif %}"
                    "{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                    "{% endif %}")


def test_warming_a_system_prompt_the_template_folds_into_the_user_turn(smol):
    """warm([system]) on such a template (Gemma 3, Mistral) cached nothing of the system prompt (the
    chat rendered empty) and said so only by a count of 0; it caches what a chat begins with now."""
    import copy
    model, tokenizer = smol
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = FOLDING_TEMPLATE
    warm, cold = Engine(model, tokenizer), Engine(model, tokenizer, cache_bytes=0)
    system = [{"role": "system", "content": SYSTEM}]
    warmed = warm.warm(system)
    assert warmed > 100
    chat = system + [{"role": "user", "content": "Hi, who are you?"}]
    reply = warm.chat(chat, max_new_tokens=8)
    assert reply.reused_tokens >= warmed and reply.token_ids == cold.chat(chat, max_new_tokens=8).token_ids
    with pytest.raises(InputError, match="all messages are empty"):       # refused as a chat is, as before
        warm.warm([{"role": "system", "content": ""}])
    with pytest.raises(InputError, match="add_generation_prompt must be a bool"):
        warm.chat(chat, template_kwargs={"add_generation_prompt": None}, max_new_tokens=2)


def test_pinned_system_prompt_survives_pressure(smol):
    model, tokenizer = smol
    small = Engine(model, tokenizer, cache_bytes=400 * 46080)
    system = [{"role": "system", "content": SYSTEM}]
    pinned = small.warm(system, pin=True)
    assert pinned > 100
    counted = {k: small.stats()[k] for k in ("lookups", "hits", "hit_tokens")}
    assert counted == {"lookups": 1, "hits": 0, "hit_tokens": 0}      # its own count was a second lookup, a hit
    assert small.warm(system) == pinned and small.stats()["lookups"] == 2
    for n in range(3):
        small.chat([{"role": "user", "content": f"Unrelated question {n}: " + "why is the sky blue? " * 8}],
                   max_new_tokens=4)
    g = small.chat(system + [{"role": "user", "content": "Hi"}], max_new_tokens=4)
    assert g.reused_tokens >= pinned
    assert small.stats()["pinned_bytes"] > 0


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(engine):
    messages = [{"role": "user", "content": "Invent a name for a cat."}]
    a = engine.chat(messages, max_new_tokens=12, temperature=0.9, top_p=0.95, seed=7)
    b = engine.chat(messages, max_new_tokens=12, temperature=0.9, top_p=0.95, seed=7)
    assert a.token_ids == b.token_ids
    greedy = engine.chat(messages, max_new_tokens=12)
    assert engine.chat(messages, max_new_tokens=12, temperature=1.5, top_k=1, seed=1).token_ids == greedy.token_ids
