"""Node-aligned prompt building and packing, without a model."""
from __future__ import annotations

import pytest

pytest.importorskip("llama_index.core")

from llama_index.core.base.llms.types import MessageRole  # noqa: E402
from llama_index.core.prompts import PromptTemplate  # noqa: E402
from llama_index.core.prompts.chat_prompts import CHAT_REFINE_PROMPT, CHAT_TEXT_QA_PROMPT  # noqa: E402

from kvboost_integrations.llama_index import DOCUMENT_BLOCKS, to_engine_messages  # noqa: E402
from kvboost_integrations.llama_index.packing import SEPARATOR_TOKENS, fit_texts, pack, template_messages  # noqa: E402
from kvboost_integrations.llama_index.telemetry import SynthesisTelemetry  # noqa: E402


def words(text: str) -> list[str]:
    """A stand-in tokenizer: one token per word."""
    return text.split()


def test_each_node_is_its_own_document_part_between_template_text():
    messages = template_messages(CHAT_TEXT_QA_PROMPT, None, "context_str", ["Node A.", "Node B."],
                                 mark_documents=True, query_str="why?")
    assert [m.role for m in messages] == [MessageRole.SYSTEM, MessageRole.USER]
    parts = to_engine_messages(messages)[1]["content"]
    assert [p["type"] for p in parts] == ["text", "document", "document", "text"]
    assert parts[0]["text"] == "Context information is below.\n---------------------"
    assert [p["text"] for p in parts[1:3]] == ["Node A.", "Node B."]
    assert parts[3]["text"].startswith("---------------------\nGiven the context") and "Query: why?" in parts[3]["text"]


def test_refine_template_and_plain_mode_for_other_llms():
    messages = template_messages(CHAT_REFINE_PROMPT, None, "context_msg", ["Node C."], mark_documents=True,
                                 query_str="q", existing_answer="old")
    assert messages[0].additional_kwargs[DOCUMENT_BLOCKS] == [1]
    assert "Original Answer: old" in messages[0].blocks[2].text
    plain = template_messages(PromptTemplate("Ctx:\n{context_str}\nQ: {query_str}"), None, "context_str",
                              ["one", "two"], mark_documents=False, query_str="q")
    assert plain[0].content == "Ctx:\n\none\n\ntwo\n\nQ: q" and not plain[0].additional_kwargs


def test_template_without_or_with_repeated_context_variable_is_rejected():
    with pytest.raises(ValueError, match="no {context_str}"):
        template_messages(PromptTemplate("Q: {query_str}"), None, "context_str", ["x"],
                          mark_documents=True, query_str="q")
    with pytest.raises(ValueError, match="more than once"):
        template_messages(PromptTemplate("{context_str} and {context_str}"), None, "context_str", ["x"],
                          mark_documents=True)


def test_pack_keeps_whole_nodes_in_order_within_budget():
    texts = ["a b c", "d e", "f g h i", "j"]
    budget = 3 + 2 + 2 * SEPARATOR_TOKENS
    groups = pack(texts, words, budget=budget)
    assert groups == [["a b c", "d e"], ["f g h i", "j"]]
    assert all(sum(len(words(t)) + SEPARATOR_TOKENS for t in g) <= budget for g in groups)
    assert [t for g in groups for t in g] == texts
    assert pack(texts, words, budget=100) == [texts]


def test_fit_texts_cuts_only_nodes_longer_than_a_call():
    long = " ".join(f"w{i}" for i in range(30))
    fitted = fit_texts(["short one", long], words, budget=10 + SEPARATOR_TOKENS)
    assert fitted[0] == "short one"
    assert len(fitted) > 2 and all(len(words(t)) <= 10 for t in fitted)
    assert " ".join(fitted[1:]).split() == long.split()
    with pytest.raises(ValueError, match="leaves only"):
        fit_texts(["x"], words, budget=1)


def test_telemetry_sums_calls_and_reports_document_reuse():
    telemetry = SynthesisTelemetry()
    telemetry.add({"kvboost": {"prompt_tokens": 100, "reused_tokens": 40, "document_tokens": 60,
                               "document_tokens_reused": 30, "ttft_s": 0.5}})
    telemetry.add({"kvboost": {"prompt_tokens": 50, "reused_tokens": 50, "document_tokens": 20,
                               "document_tokens_reused": 20, "ttft_s": 0.1}})
    telemetry.add(None)                                   # another LLM: counted as a call only
    data = telemetry.data
    assert data["llm_calls"] == 3 and data["prompt_tokens"] == 150 and data["reused_tokens"] == 90
    assert data["document_reuse"] == pytest.approx(50 / 80)
    assert data["ttft_s"] == 0.1 and len(data["calls"]) == 2


def test_document_reuse_counts_documents_inside_the_exact_prefix_plus_moved():
    from kvboost_engine import Generation
    from kvboost_engine.request.tokens import TokenizedPrompt
    from kvboost_integrations._bridge import document_reuse

    # glue 0-10, document 10-40, glue 40-42, document 42-62, query 62-70
    prompt = TokenizedPrompt(list(range(70)), [10, 40, 42, 62, 70], ["glue", "document", "glue", "document", "user"])
    assert document_reuse(prompt, Generation(reused_exact=25)) == {"document_tokens": 50, "document_tokens_reused": 15}
    assert document_reuse(prompt, Generation(reused_exact=50))["document_tokens_reused"] == 30 + 8
    assert document_reuse(prompt, Generation(reused_exact=10, reused_moved=20))["document_tokens_reused"] == 20
    assert document_reuse(prompt, Generation(reused_exact=69, reused_moved=5))["document_tokens_reused"] == 50
