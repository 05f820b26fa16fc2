"""Moved reuse: documents cached once are found again at other positions and orders."""
import random

import pytest
import torch

from kvboost_engine import Engine
from test_cache import fake_kv, insert, make_cache

TOPICS = ["volcanoes", "honey bees", "Roman aqueducts", "tidal energy", "the Mongolian steppe", "glass blowing"]


def make_docs(seed=0):
    rng = random.Random(seed)
    return [f"Notes on {t}. " + " ".join(
        f"Observation {i}: the {t} record {rng.randint(100, 999)} shows a change of {rng.randint(1, 50)} units."
        for i in range(7)) for t in TOPICS]


DOCS = make_docs()


def as_parts(order, question):
    parts = [{"type": "document", "text": DOCS[i]} for i in order] + [{"type": "text", "text": question}]
    return [{"role": "system", "content": "Answer from the notes."}, {"role": "user", "content": parts}]


def as_plain(order, question):
    return "Use the context.\n\nContext:\n" + "\n\n".join(DOCS[i] for i in order) + f"\n\nQuestion: {question}\nAnswer:"


def document_tokens(engine, order):
    return sum(len(engine.tokenizer(DOCS[i], add_special_tokens=False)["input_ids"]) for i in order)


# ---- cache level ---------------------------------------------------------------------------
def test_content_hit_grows_over_the_seam_and_reports_source_positions():
    cache = make_cache(10_000)
    doc = list(range(500, 540))
    first = [1, 2, 3] + doc + [9]
    insert(cache, first, [3, 20, 43, 44], chunk_kinds=["glue", "document", "document", "glue"])
    second = [7, 7, 7, 7, 7] + doc + [8, 8]
    # the new prompt's first doc chunk is not aligned with the stored one: growth must cover it
    spans = cache.match_moved(second, [4, 22, 45, 47], ["glue", "document", "document", "glue"], 0, 46)
    assert len(spans) == 1
    span = spans[0]
    assert (span.start, span.length, span.source_start) == (5, 40, 3)
    got = cache.pool.read(span.table, span.source_start, span.length)
    cache.release(span.table)
    assert torch.equal(got, fake_kv(first, 3, 43))


def test_content_index_survives_splits_and_eviction():
    cache = make_cache(120)
    doc = list(range(500, 540))
    a = [1] + doc
    insert(cache, a, [1, 41], chunk_kinds=["glue", "document"])
    b = [1] + doc[:10] + [3, 3, 3]                  # splits the document node
    insert(cache, b, [1, 14], chunk_kinds=["glue", "text"])
    cache.check_invariants()
    spans = cache.match_moved([5, 5] + doc, [2, 42], ["glue", "document"], 0, 42)
    assert [(s.start, s.length, s.source_start) for s in spans] == [(2, 40, 1)]
    for span in spans:
        cache.release(span.table)
    for i in range(4):                               # pressure: the old entries go
        c = [50 + i] * 40
        insert(cache, c, [40], chunk_kinds=["text"])
        cache.check_invariants()
    assert cache.match_moved([5, 5] + doc, [2, 42], ["glue", "document"], 0, 42) == []


# ---- engine level --------------------------------------------------------------------------
ORDERS = [[3, 1, 4, 0, 2], [2, 4, 1, 3, 0], [0, 3, 2, 4, 1]]


@pytest.mark.parametrize("form", ["parts", "plain"])
def test_by_default_shuffled_documents_give_the_replies_of_no_cache(engine, cold_engine, form):
    """Moved reuse is opt-in: the default engine reuses only exact prefixes, so replies equal a full prefill."""
    question = "Which record belongs to the tidal energy notes?"
    ask = (lambda e, o: e.chat(as_parts(o, question), max_new_tokens=12)) if form == "parts" else \
        (lambda e, o: e.generate(as_plain(o, question), max_new_tokens=12))
    ask(engine, range(6))
    for order in ORDERS + [ORDERS[0]]:
        g = ask(engine, order)
        assert g.reused_moved == 0 and g.token_ids == ask(cold_engine, order).token_ids
    assert g.reused_exact >= document_tokens(engine, ORDERS[0])           # the repeat is reused exactly


@pytest.mark.parametrize("form", ["parts", "plain"])
def test_shuffled_documents_seen_before_are_reused(moved_engine, form):
    engine = moved_engine
    question = "Which record belongs to the tidal energy notes?"
    if form == "parts":
        engine.chat(as_parts(range(6), "Summarise."), max_new_tokens=1)
        runs = [engine.chat(as_parts(order, question), max_new_tokens=1) for order in ORDERS]
    else:
        engine.generate(as_plain(range(6), "Summarise."), max_new_tokens=1)
        runs = [engine.generate(as_plain(order, question), max_new_tokens=1) for order in ORDERS]
    for order, g in zip(ORDERS, runs):
        docs = document_tokens(engine, order)
        prefix = g.reused_exact
        assert g.reused_moved >= 0.9 * docs - prefix, (form, g.telemetry(), docs)
        assert g.reused_exact + g.reused_moved <= g.prompt_tokens - 1
        assert 0 < g.recomputed < 0.3 * g.reused_moved
    engine.cache.check_invariants()


def test_blend_with_full_ratio_equals_no_cache(smol, cold_engine):
    model, tokenizer = smol
    engine = Engine(model, tokenizer, moved_reuse="blend", recompute_ratio=1.0)
    engine.chat(as_parts(range(6), "Summarise."), max_new_tokens=1)
    messages = as_parts([4, 0, 2], "What does the volcanoes record show?")
    logits = engine.next_token_logits(messages=messages)
    assert engine.stats()["moved_hits"] > 0
    assert torch.allclose(logits, cold_engine.next_token_logits(messages=messages), atol=1e-4)


def test_full_strategy_is_exact_and_none_recomputes_nothing(smol, cold_engine):
    model, tokenizer = smol
    messages = as_parts([5, 1, 3], "What do the glass blowing notes record?")
    full = Engine(model, tokenizer, moved_reuse="full")
    none = Engine(model, tokenizer, moved_reuse="none")
    for e in (full, none):
        e.chat(as_parts(range(6), "Summarise."), max_new_tokens=1)
    g_full = full.chat(messages, max_new_tokens=8)
    assert g_full.reused_moved == 0 and g_full.token_ids == cold_engine.chat(messages, max_new_tokens=8).token_ids
    g_none = none.chat(messages, max_new_tokens=8)
    assert g_none.reused_moved > 0.8 * document_tokens(none, [5, 1, 3]) and g_none.recomputed == 0


def test_repaired_kv_is_never_reported_as_exact(moved_engine):
    engine = moved_engine
    engine.chat(as_parts(range(6), "Summarise."), max_new_tokens=1)
    messages = as_parts([2, 0], "What about the aqueducts?")
    first = engine.chat(messages, max_new_tokens=4)
    again = engine.chat(messages, max_new_tokens=4)
    assert first.reused_moved > 0
    assert again.reused_exact <= first.reused_exact + 1      # the prefix before the first moved document
    assert again.reused_moved >= first.reused_moved
    engine.cache.check_invariants()


def test_the_default_never_reuses_another_engines_repaired_kv_from_a_shared_disk(smol, cold_engine, tmp_path):
    """A blend engine's repaired (inexact) chunks reach the disk folder a default engine reads too
    (the same model, so the same fingerprint): the default engine used them as a prefix, and its
    reply differed from no cache's."""
    model, tokenizer = smol
    docs = ["The Eiffel Tower is in Paris and was built in 1889 for the World's Fair. It is 330 metres tall.",
            "Mount Fuji is the highest mountain in Japan at 3776 metres. It is an active volcano."]

    def messages(order, question):
        return [{"role": "user", "content": [{"type": "document", "text": docs[i]} for i in order]
                 + [{"type": "text", "text": question}]}]
    blend = Engine(model, tokenizer, moved_reuse="blend", disk_cache_dir=str(tmp_path))
    blend.chat(messages([0, 1], "Which is taller?"), max_new_tokens=1)
    assert blend.chat(messages([1, 0], "How tall is the tower?"), max_new_tokens=1).reused_moved > 0
    blend.close()
    default = Engine(model, tokenizer, disk_cache_dir=str(tmp_path))
    prompt = messages([1, 0], "How tall is the tower? Answer in one sentence.")
    reply = default.chat(prompt, max_new_tokens=12)
    assert reply.reused_moved == 0
    assert reply.token_ids == cold_engine.chat(prompt, max_new_tokens=12).token_ids
    again = default.chat(prompt, max_new_tokens=12)        # its own exact KV took the place: reused now
    assert again.reused_moved == 0 and again.reused_exact >= reply.prompt_tokens - 16
    assert again.token_ids == reply.token_ids
    default.close()
    restarted = Engine(model, tokenizer, disk_cache_dir=str(tmp_path))   # its exact KV replaced the file
    after = restarted.chat(prompt, max_new_tokens=12)
    assert after.reused_moved == 0 and after.reused_exact >= reply.prompt_tokens - 16
    assert after.token_ids == reply.token_ids
    restarted.close()
