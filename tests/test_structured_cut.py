"""A structured reply cut by the token budget is an error in both frameworks, never a partial object:
the held-out order schema (at least 6 lines, no maximum, a required note) run out of max_tokens."""
from __future__ import annotations

import pytest

pytest.importorskip("langchain_core")

from kvboost_engine import Engine  # noqa: E402
from kvboost_integrations.langchain import ChatKVBoost, LengthCutError  # noqa: E402

ORDER = {
    "title": "Order", "type": "object", "required": ["lines", "note"], "additionalProperties": False,
    "properties": {
        "lines": {"type": "array", "minItems": 6, "items": {
            "type": "object", "required": ["item", "qty"], "additionalProperties": False,
            "properties": {"item": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}}}},
        "note": {"type": "string"},
    },
}
ASK = "Write an order for a bakery: bread, cakes and rolls."


@pytest.fixture(scope="module")
def cut_engine(smol):
    engine = Engine(*smol, cache_bytes=64 * 2**20)
    yield engine
    engine.close()


@pytest.mark.parametrize("method", ["json_schema", "json_mode", "function_calling"])
def test_a_cut_structured_reply_raises_and_names_the_budget(cut_engine, method):
    llm = ChatKVBoost(engine=cut_engine, max_tokens=24)
    with pytest.raises(LengthCutError, match=r"finish_reason='length' after 24 tokens"):
        llm.with_structured_output(ORDER, method=method).invoke(ASK)


def test_a_streamed_structured_reply_gives_partial_objects_then_the_whole_or_the_cut(cut_engine):
    person = {"title": "Person", "type": "object", "required": ["name", "age"],
              "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
    llm = ChatKVBoost(engine=cut_engine, max_tokens=40)
    structured = llm.with_structured_output(person)
    whole = structured.invoke("Extract: John is 30.")
    streamed = list(structured.stream("Extract: John is 30."))
    assert len(streamed) > 2 and streamed[-1] == whole                # partial objects first, as ChatOpenAI's
    with pytest.raises(LengthCutError, match=r"finish_reason='length' after 24 tokens"):
        list(ChatKVBoost(engine=cut_engine, max_tokens=24).with_structured_output(ORDER).stream(ASK))


def test_include_raw_gives_the_cut_as_parsing_error(cut_engine):
    llm = ChatKVBoost(engine=cut_engine, max_tokens=24)
    out = llm.with_structured_output(ORDER, include_raw=True).invoke(ASK)
    assert out["parsed"] is None and isinstance(out["parsing_error"], LengthCutError)
    assert out["raw"].response_metadata["finish_reason"] == "length"


def test_llama_index_structured_predict_refuses_a_cut_even_when_it_would_validate(cut_engine):
    pytest.importorskip("llama_index.core")
    from llama_index.core.base.llms.types import ChatMessage, ChatResponse
    from pydantic import BaseModel

    from kvboost_integrations.llama_index.tools import parse_structured

    class Note(BaseModel):
        text: str
    whole = ChatResponse(message=ChatMessage(role="assistant", content='{"text": "ab"}'),
                         raw={"kvboost": {"finish_reason": "length"}, "usage": {"completion_tokens": 7}})
    with pytest.raises(ValueError, match=r"finish_reason='length' after 7 tokens"):
        parse_structured(Note, whole)
    whole.raw["kvboost"]["finish_reason"] = "stop"
    assert parse_structured(Note, whole).text == "ab"
