"""RAG speed without approximation: cache-aware document order, warming documents where they will be
used, and documents carried in chat history, all reused exactly (replies as with no cache)."""
import pytest

from test_moved_reuse import DOCS, as_parts

SYSTEM = "Answer from the notes."


def doc_order(messages):
    return [DOCS.index(p["text"]) for p in messages[1]["content"] if p["type"] == "document"]


def test_documents_that_continue_a_cached_sequence_go_first_and_are_reused_exactly(engine, cold_engine):
    engine.chat(as_parts([3, 1, 4], "First question?"), max_new_tokens=1)
    ordered, placed = engine.order_documents(as_parts([1, 5, 3, 4], "Second question?"))
    assert placed == 3 and doc_order(ordered) == [3, 1, 4, 5]             # the cached sequence, then the rest
    g = engine.chat(ordered, max_new_tokens=8)
    layout = engine.encode_messages(as_parts([3, 1, 4], "x"))
    last_doc = max(i for i, kind in enumerate(layout.chunk_kinds) if kind == "document")
    assert g.reused_moved == 0 and g.reused_exact >= layout.chunk_ends[last_doc]     # all three, exactly
    assert g.token_ids == cold_engine.chat(ordered, max_new_tokens=8).token_ids


def test_nothing_cached_keeps_the_relevance_order(engine):
    ordered, placed = engine.order_documents(as_parts([2, 0, 5], "Anything?"))
    assert placed == 0 and doc_order(ordered) == [2, 0, 5]
    ordered, placed = engine.order_documents([{"role": "user", "content": "no documents"}])
    assert placed == 0 and ordered == [{"role": "user", "content": "no documents"}]


def test_warmed_documents_are_reused_exactly_when_they_come_first(engine, cold_engine):
    engine.warm_documents([DOCS[4], DOCS[0]], system=SYSTEM)
    ordered, placed = engine.order_documents(as_parts([2, 0, 5], "Which record is about glass?"))
    assert placed == 1 and doc_order(ordered) == [0, 2, 5]
    g = engine.chat(ordered, max_new_tokens=8)
    assert g.reused_exact > len(engine.tokenizer(DOCS[0])["input_ids"]) and g.reused_moved == 0
    assert g.token_ids == cold_engine.chat(ordered, max_new_tokens=8).token_ids


def test_documents_carried_in_chat_history_are_reused_exactly(engine, cold_engine):
    messages = as_parts([1, 2], "What do the bee notes record?")
    first = engine.chat(messages, max_new_tokens=10)
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And the aqueducts?"}]
    second = engine.chat(messages, max_new_tokens=10)
    assert second.reused_exact >= first.prompt_tokens and second.reused_moved == 0
    assert second.token_ids == cold_engine.chat(messages, max_new_tokens=10).token_ids


def segments(order, question):
    return ([{"text": "Notes:\n", "kind": "system"}] + [{"text": f"{DOCS[i]}\n", "kind": "document"} for i in order]
            + [{"text": f"Q: {question}\nA:", "kind": "text"}])


def test_plain_prompt_segments_are_ordered_the_same_way(engine, cold_engine):
    engine.generate(segments([3, 1], "First?"), max_new_tokens=1)
    prompt = segments([1, 5, 3], "Second?")
    ordered, placed = engine.order_documents(prompt)
    assert placed == 2 and [s["text"] for s in ordered[1:4]] == [f"{DOCS[i]}\n" for i in (3, 1, 5)]
    assert ordered[0] is prompt[0] and ordered[-1] is prompt[-1]           # the items given, reordered
    g = engine.generate(ordered, max_new_tokens=8)
    assert g.reused_moved == 0 and g.reused_exact >= engine.count_tokens("Notes:\n" + DOCS[3] + "\n")
    assert g.token_ids == cold_engine.generate(ordered, max_new_tokens=8).token_ids
    assert engine.order_documents(segments([2, 0], "None cached?"))[1] == 0


def test_bad_documents_are_input_errors(engine):
    from kvboost_engine import InputError
    with pytest.raises(InputError):
        engine.warm_documents([5])
    with pytest.raises(InputError):
        engine.order_documents("not messages")
    with pytest.raises(InputError):
        engine.order_documents([{"text": "a segment"}, 5])
    with pytest.raises(InputError):
        engine.order_documents(5)


def test_an_empty_document_is_not_counted_as_placed_from_the_cache(engine):
    """It adds no chunk, so it seemed to continue whatever the document before it continued."""
    engine.chat(as_parts([3], "First question?"), max_new_tokens=1)
    message = as_parts([3, 1], "Second?")
    message[1]["content"].insert(2, {"type": "document", "text": ""})
    ordered, placed = engine.order_documents(message)
    assert placed == 1
    texts = [p["text"] for p in ordered[1]["content"] if p["type"] == "document"]
    assert texts == [DOCS[3], DOCS[1], ""]
