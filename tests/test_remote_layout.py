"""The remote backend's prompt layout, routing and /metrics parsing (no server needed)."""
from __future__ import annotations

import collections

import pytest

from kvboost_engine import InputError
from kvboost_integrations.remote import LayoutOptions, PromptLayout, Router, parse_metrics, prefix_counters
from kvboost_integrations.remote.sequences import DocumentSequences

SYSTEM = {"role": "system", "content": "You answer from the documents."}


def rag(docs, question="Which one?"):
    parts = [{"type": "document", "text": d} for d in docs] + [{"type": "text", "text": question}]
    return [SYSTEM, {"role": "user", "content": parts}]


def documents_sent(prompt, docs):
    content = prompt.messages[-1]["content"]
    return sorted(docs, key=content.index)


def test_documents_follow_the_order_sent_before_and_new_ones_keep_relevance_order():
    layout = PromptLayout()
    first = layout.lay_out(rag(["A doc", "B doc", "C doc"]))
    assert documents_sent(first, ["A doc", "B doc", "C doc"]) == ["A doc", "B doc", "C doc"]
    # the same documents retrieved in another order: sent in the order the server has cached
    again = layout.lay_out(rag(["C doc", "A doc", "B doc"], "Another question?"))
    assert documents_sent(again, ["A doc", "B doc", "C doc"]) == ["A doc", "B doc", "C doc"]
    # an overlapping set: the cached run first (A, B), then the new ones as retrieved (E, D)
    mixed = layout.lay_out(rag(["E doc", "B doc", "D doc", "A doc"]))
    assert documents_sent(mixed, ["A doc", "B doc", "D doc", "E doc"]) == ["A doc", "B doc", "E doc", "D doc"]
    assert (first.placed, again.placed, mixed.placed) == (0, 3, 2)
    assert mixed.messages[-1]["content"].endswith("Which one?")


def test_relevance_order_is_kept_when_asked():
    layout = PromptLayout(LayoutOptions(document_order="relevance"))
    layout.lay_out(rag(["A doc", "B doc"]))
    again = layout.lay_out(rag(["B doc", "A doc"]))
    assert documents_sent(again, ["A doc", "B doc"]) == ["B doc", "A doc"]


def test_remembered_order_depends_on_what_precedes_the_documents():
    layout = PromptLayout()
    layout.lay_out(rag(["A doc", "B doc"]))
    other = [{"role": "system", "content": "Another system prompt."}, rag(["B doc", "A doc"])[1]]
    assert documents_sent(layout.lay_out(other), ["A doc", "B doc"]) == ["B doc", "A doc"]


def test_the_default_layout_sends_the_text_as_given():
    messages = [{"role": "system", "content": "You are a helpful assistant. Today is 2026-12-01. Our support line is "
                 "1800123456."}, {"role": "user", "content": "Hi"}]
    prompt = PromptLayout().lay_out(messages)
    assert prompt.messages == messages and prompt.moved_volatile == []


def test_volatile_sentences_leave_the_system_prompt_for_the_last_message():
    layout = PromptLayout(LayoutOptions(volatile="last"))
    messages = [{"role": "system", "content": "You are helpful. Today is 2026-11-30 13:05.\nRequest id "
                 "3f2b1c9e-8a7d-4e6f-9b0a-1c2d3e4f5a6b\nBe brief."},
                {"role": "user", "content": "Hi"}]
    prompt = layout.lay_out(messages)
    assert prompt.messages[0]["content"] == "You are helpful.\nBe brief."
    assert prompt.messages[1]["content"] == ("Today is 2026-11-30 13:05.\nRequest id "
                                             "3f2b1c9e-8a7d-4e6f-9b0a-1c2d3e4f5a6b\n\nHi")
    assert prompt.moved_volatile == ["Today is 2026-11-30 13:05.", "Request id 3f2b1c9e-8a7d-4e6f-9b0a-1c2d3e4f5a6b"]
    # the next request, at another time, has the same prefix and the same route key
    later = layout.lay_out([{**messages[0], "content": messages[0]["content"].replace("13:05", "13:09")},
                            messages[1]])
    assert later.messages[0] == prompt.messages[0] and later.route_key == prompt.route_key
    kept = PromptLayout(LayoutOptions(volatile="keep")).lay_out(messages)
    assert kept.messages[0]["content"] == messages[0]["content"]


def test_volatile_sentences_go_to_the_last_user_message_never_to_a_tool_or_assistant_one():
    layout = PromptLayout(LayoutOptions(volatile="last"))
    messages = [{"role": "system", "content": "Be brief. Now: 2026-11-30T10:00:00Z"},
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]},
                {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    wire = layout.lay_out(messages).messages
    assert wire[1]["content"] == "Now: 2026-11-30T10:00:00Z\n\nWeather?" and wire[3]["content"] == "sunny"
    no_user = [messages[0], {"role": "assistant", "content": "Hello."}]
    assert layout.lay_out(no_user).messages == no_user                    # nowhere to go: left alone


def test_volatile_text_goes_before_the_question_after_the_documents():
    messages = [{"role": "system", "content": "Now: 2026-11-30T10:00:00Z"}, rag(["A doc"], "Q?")[1]]
    prompt = PromptLayout(LayoutOptions(volatile="last")).lay_out(messages)
    assert [m["role"] for m in prompt.messages] == ["user"]          # the emptied system message is gone
    assert prompt.messages[0]["content"] == "A doc\n\nNow: 2026-11-30T10:00:00Z\n\nQ?"


def test_cacheblend_separator_goes_around_documents():
    prompt = PromptLayout(LayoutOptions(blend_separator=" # # ")).lay_out(rag(["A doc", "B doc"], "Q?"))
    assert prompt.messages[1]["content"] == " # # A doc # # B doc # # Q?"
    assert prompt.messages[0]["content"] == SYSTEM["content"]


def test_route_key_is_the_leading_segments():
    layout = PromptLayout(LayoutOptions(document_order="relevance"))
    a = layout.lay_out(rag(["A doc", "B doc"], "Question one?"))
    b = layout.lay_out(rag(["A doc", "C doc"], "Question two?"))
    c = layout.lay_out(rag(["C doc", "A doc"], "Question one?"))
    assert a.route_key == b.route_key != c.route_key
    chat = [SYSTEM, {"role": "user", "content": "first turn"}]
    longer = chat + [{"role": "assistant", "content": "reply"}, {"role": "user", "content": "second turn"}]
    assert layout.lay_out(chat).route_key == layout.lay_out(longer).route_key
    other = [SYSTEM, {"role": "user", "content": "another conversation"}]
    assert layout.lay_out(other).route_key != layout.lay_out(chat).route_key


def test_earlier_thinking_goes_to_our_server_only():
    """An assistant turn's reasoning_content reaches our own server's template (which keeps it in a
    tool loop, as a local engine's does: 65 prompt tokens against 82 before); other servers get
    the plain OpenAI message."""
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": "", "reasoning_content": "I need the tool.",
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    prompt = PromptLayout().lay_out(history)
    assert [m.get("reasoning_content") for m in prompt.part_messages] == [None, "I need the tool.", None]
    assert not any("reasoning_content" in m for m in prompt.messages)


def test_tool_calls_and_results_go_out_in_openai_form():
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    wire = PromptLayout().lay_out(messages).messages
    assert wire[1] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]}
    assert wire[2] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}


def test_bad_layout_input_is_an_error():
    with pytest.raises(InputError, match="document_order"):
        LayoutOptions(document_order="random")
    with pytest.raises(InputError, match="at least one message"):
        PromptLayout().lay_out([])
    with pytest.raises(InputError, match="image"):
        PromptLayout().lay_out([{"role": "user", "content": [{"type": "image", "url": "x"}]}])


def test_document_sequences_forget_least_recently_used_branches():
    sequences = DocumentSequences(capacity=4)
    assert sequences.order(1, ["a", "b"]) == (["a", "b"], 0)
    assert sequences.order(2, ["c", "d"]) == (["c", "d"], 0)      # 6 nodes > 4: prefix 1's branch is forgotten
    assert sequences.order(1, ["b", "a"], record=False) == (["b", "a"], 0)
    assert sequences.order(2, ["d", "c"], record=False) == (["c", "d"], 2)


def test_consistent_hashing_keeps_keys_on_their_replica_and_spreads_them():
    names = [f"http://r{i}/v1" for i in range(3)]
    router = Router(names)
    owners = {key: router.candidates(key)[0] for key in range(0, 2**64, 2**64 // 300)}
    assert all(router.candidates(key)[0] == owner for key, owner in owners.items())
    counts = collections.Counter(owners.values())
    assert len(counts) == 3 and min(counts.values()) > 50
    smaller = Router(names[:2])        # a replica leaves: only its keys move
    moved = sum(smaller.candidates(k)[0] != o for k, o in owners.items() if o != names[2])
    assert moved == 0


def test_bounded_load_sends_a_hot_key_elsewhere_and_down_replicas_last():
    names = ["http://a/v1", "http://b/v1"]
    router = Router(names, load_factor=1.0)
    first = router.candidates(7)[0]
    router.begin(first)
    assert router.candidates(7)[0] != first            # its owner holds more than its share
    router.end(first)
    assert router.candidates(7)[0] == first
    router.mark_down(first)
    assert router.candidates(7) == [n for n in names if n != first] + [first]
    router.mark_up(first)
    assert router.candidates(7)[0] == first


def test_round_robin_rotates():
    router = Router(["http://a/v1", "http://b/v1"], policy="round_robin")
    assert [router.candidates(7)[0] for _ in range(4)] == ["http://a/v1", "http://b/v1"] * 2


def test_router_input_errors():
    with pytest.raises(InputError, match="at least one"):
        Router([])
    with pytest.raises(InputError, match="differ"):
        Router(["http://a/v1", "http://a/v1"])
    with pytest.raises(InputError, match="routing"):
        Router(["http://a/v1"], policy="random")


def test_metrics_of_vllm_and_llama_server():
    vllm = parse_metrics('# HELP x\nvllm:prefix_cache_queries_total{engine="0",model_name="m"} 300.0\n'
                         'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 128.0\n'
                         'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 128.0\n')
    assert prefix_counters(vllm).as_dict() == {"queries": 300, "hits": 256, "hit_rate": 256 / 300}
    llama = parse_metrics("llamacpp:prompt_tokens_total 40\nllamacpp:prompt_tokens_cached_total 60\n")
    assert prefix_counters(llama).hit_rate == 0.6
    assert prefix_counters(parse_metrics("other_total 1\n")) is None
