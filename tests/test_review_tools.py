"""Tool calls and structured output as the reviewers broke them: a `</tool_call>` inside a call's
argument, unreadable arguments in LlamaIndex, dict schemas LangChain's converter shrank, and a forced
call asked for together with another constraint."""
import json
from typing import Literal

import pytest

pytest.importorskip("langchain_core")
pytest.importorskip("llama_index.core")

from langchain_core.tools import tool  # noqa: E402
from llama_index.core.base.llms.types import ChatMessage, ChatResponse, ToolCallBlock  # noqa: E402
from llama_index.core.tools import FunctionTool  # noqa: E402

from kvboost_engine import Engine  # noqa: E402
from kvboost_engine.constrained import JsonSchema  # noqa: E402
from kvboost_engine.toolcalls import HERMES  # noqa: E402
from kvboost_integrations.langchain import ChatKVBoost  # noqa: E402
from kvboost_integrations.llama_index import KVBoost  # noqa: E402
from kvboost_integrations.llama_index.tools import tool_selections  # noqa: E402

TRICKY = "a</tool_call>b"


@pytest.fixture(scope="module")
def review_engine(smol):
    engine = Engine(*smol, cache_bytes=128 * 2**20)
    yield engine
    engine.close()


@tool
def save_snippet(text: Literal["a</tool_call>b", "plain"]) -> str:
    """Save an HTML/XML snippet."""
    return "ok"


def save(text: Literal["a</tool_call>b", "plain"] = "plain") -> str:
    """Save a snippet."""
    return f"saved {text!r}"


def test_a_closing_tag_inside_an_argument_is_part_of_the_argument():
    """The Hermes parser cut a call at the first `</tool_call>`, even one inside a JSON string: the
    call came back with arguments that were not JSON (and the call after it was lost)."""
    text = ('<tool_call>\n{"name": "save", "arguments": {"text": "a</tool_call>b"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "save", "arguments": {"text": "plain"}}\n</tool_call>')
    content, calls = HERMES.parse(text)
    assert content == "" and [(c["name"], json.loads(c["args"])) for c in calls] == [
        ("save", {"text": TRICKY}), ("save", {"text": "plain"})]
    _, [unreadable] = HERMES.parse('<tool_call>\n{"name": "save", "arguments": Rome}\n</tool_call>')
    assert unreadable["name"] == "save" and unreadable["args"] == '{"name": "save", "arguments": Rome}'


def test_langchain_forced_call_with_a_closing_tag_in_its_argument(review_engine):
    """A forced call whose argument holds `</tool_call>` came back as the call's wrapper object with a
    cut value (`{"name": ..., "arguments": {"text": "<tool_call>x`)."""
    chat = ChatKVBoost(engine=review_engine, max_tokens=60).bind_tools([save_snippet], tool_choice="save_snippet")
    message = chat.invoke('Save the snippet "a</tool_call>b".')
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [("save_snippet", {"text": TRICKY})]
    assert message.invalid_tool_calls == []


def test_llama_index_forced_call_with_a_closing_tag_and_unreadable_arguments(review_engine):
    """LlamaIndex got the cut call as a string, which get_tool_calls_from_response turned into {}: the
    tool ran with its defaults. Unreadable arguments are now an error naming the tool."""
    llm = KVBoost(engine=review_engine, max_new_tokens=60)
    response = llm.chat_with_tools([FunctionTool.from_defaults(save)], f'Save the snippet "{TRICKY}".',
                                   tool_choice="save")
    [selection] = llm.get_tool_calls_from_response(response)
    assert selection.tool_name == "save" and selection.tool_kwargs == {"text": TRICKY}
    broken = ChatResponse(message=ChatMessage(role="assistant", blocks=[
        ToolCallBlock(tool_call_id="c0", tool_name="save", tool_kwargs='{"text": "a')]))
    with pytest.raises(ValueError, match="'save'.*not a JSON object"):
        tool_selections(broken)


INNER = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}, "pop": {"type": "integer",
                                                                                       "minimum": 0, "maximum": 9}},
         "required": ["city", "pop"]}
NUMBERS = {"title": "three_numbers", "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
           "minItems": 3, "maxItems": 3}


def _bound_schema(runnable):
    return runnable.first.kwargs["response_format"]


@pytest.mark.parametrize("schema, followed", [
    ({"name": "city_info", "schema": INNER, "strict": True}, INNER),
    ({"type": "json_schema", "json_schema": {"name": "city_info", "schema": INNER}}, INNER),
    (NUMBERS, NUMBERS),
    ({"title": "answer", "enum": ["yes", "no"]}, {"title": "answer", "enum": ["yes", "no"]}),
    ({"type": "array", "items": {"type": "integer"}}, {"type": "array", "items": {"type": "integer"}}),
    ({"name": "city_info", "description": "a city", "input_schema": INNER}, INNER),            # Anthropic's tool
    ({"toolSpec": {"name": "city_info", "inputSchema": {"json": INNER}}}, INNER),               # Bedrock's
])
def test_dict_schemas_are_followed_as_they_are(review_engine, schema, followed):
    """LangChain's convert_to_json_schema shrank OpenAI's {"name", "schema"} forms and titled
    non-object schemas to {"title": ...} (any JSON: unconstrained, silently), and refused an untitled
    array ("must have a top-level 'title'")."""
    llm = ChatKVBoost(engine=review_engine, max_tokens=40)
    assert _bound_schema(llm.with_structured_output(schema)) == followed


def test_a_titled_array_schema_is_generated_under_it_and_unique_items_is_refused(review_engine):
    """The titled array ran unconstrained (prose, parsed None or a wrong shape); `uniqueItems` at the
    top level returned None where the README promises a ValueError naming it."""
    llm = ChatKVBoost(engine=review_engine, max_tokens=40)
    numbers = llm.with_structured_output(NUMBERS).invoke("List three numbers.")
    assert isinstance(numbers, list) and len(numbers) == 3 and all(0 <= n <= 9 for n in numbers)
    with pytest.raises(ValueError, match="uniqueItems"):
        llm.with_structured_output({**NUMBERS, "uniqueItems": True}).invoke("List three numbers.")


@tool
def get_time() -> str:
    """time"""
    return "noon"


def test_a_forced_call_with_another_constraint_is_refused(review_engine):
    """LangChain dropped the forced call for response_format ('{}', no call); LlamaIndex dropped the
    user's constraint for the forced call. Both silently."""
    chat = ChatKVBoost(engine=review_engine, max_tokens=40)
    with pytest.raises(ValueError, match="tool_choice.*response_format"):
        chat.bind_tools([get_time], tool_choice="get_time").bind(response_format={"type": "json_object"}).invoke("Hi")
    auto = chat.bind_tools([get_time]).bind(response_format={"type": "json_object"})     # auto: JSON, as before
    assert auto.invoke("Hi").content.startswith("{")
    llm = KVBoost(engine=review_engine, max_new_tokens=40)
    with pytest.raises(ValueError, match="tool_choice.*constraint"):
        llm.chat([ChatMessage(role="user", content="Hi")], tools=[FunctionTool.from_defaults(get_time.func)],
                 tool_choice="required", constraint=JsonSchema({"type": "object", "properties": {"x": {"const": 1}},
                                                                "required": ["x"]}))
