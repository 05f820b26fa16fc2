"""Tool calls and structured output as the reviewers broke them: a `</tool_call>` inside a call's
argument, unreadable arguments in LlamaIndex, dict schemas LangChain's converter shrank, and a forced
call asked for together with another constraint."""
import json
from typing import Literal

import pytest

pytest.importorskip("langchain_core")
pytest.importorskip("llama_index.core")

from langchain_core.messages import AIMessageChunk, HumanMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from llama_index.core.base.llms.types import ChatMessage, ChatResponse, TextBlock, ToolCallBlock  # noqa: E402
from llama_index.core.tools import FunctionTool  # noqa: E402

from kvboost_engine import Engine  # noqa: E402
from kvboost_engine.constrained import JsonSchema  # noqa: E402
from kvboost_engine.toolcalls import HERMES  # noqa: E402
from kvboost_integrations.langchain import ChatKVBoost  # noqa: E402
from kvboost_integrations.llama_index import KVBoost  # noqa: E402
from kvboost_integrations.llama_index.messages import to_engine_messages  # noqa: E402
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
    auto = chat.bind_tools([get_time]).bind(response_format={"type": "json_object"})     # auto: the tools were
    with pytest.raises(ValueError, match="give one of them"):                             # dropped silently; the
        auto.invoke("Hi")                                                                  # server refuses it too
    none = chat.bind_tools([get_time], tool_choice="none").bind(response_format={"type": "json_object"})
    assert none.invoke("Hi").content.startswith("{")
    llm = KVBoost(engine=review_engine, max_new_tokens=40)
    with pytest.raises(ValueError, match="tool_choice.*constraint"):
        llm.chat([ChatMessage(role="user", content="Hi")], tools=[FunctionTool.from_defaults(get_time.func)],
                 tool_choice="required", constraint=JsonSchema({"type": "object", "properties": {"x": {"const": 1}},
                                                                "required": ["x"]}))


def test_a_streamed_reply_in_the_history_is_an_assistant_turn(review_engine):
    """A streamed reply added up is an AIMessageChunk: the next turn (RunnableWithMessageHistory, a
    tool-calling agent's scratchpad) raised "cannot send a message of role 'AIMessageChunk'"."""
    chat = ChatKVBoost(engine=review_engine, max_tokens=6)
    history = [HumanMessage("Say hi.")]
    reply = None
    for chunk in chat.stream(history):
        reply = chunk if reply is None else reply + chunk
    assert isinstance(reply, AIMessageChunk)
    history += [reply, HumanMessage("Again.")]
    again = chat.invoke(history)
    assert again.usage_metadata["input_tokens"] == chat.get_num_tokens_from_messages(history)
    assert again.response_metadata["reused_tokens"] > 0


def test_bind_tools_takes_strict_and_an_empty_llama_index_tool_list_is_a_plain_chat(review_engine):
    chat = ChatKVBoost(engine=review_engine, max_tokens=30)
    call = chat.bind_tools([get_time], tool_choice="get_time", strict=True).invoke("What time is it?")
    assert [c["name"] for c in call.tool_calls] == ["get_time"]
    with pytest.raises(ValueError, match="strict must be a bool"):
        chat.bind_tools([get_time], strict="yes")
    llm = KVBoost(engine=review_engine, max_new_tokens=4)                 # LlamaIndex adds tool_choice="auto"
    reply = llm.chat_with_tools([], chat_history=[ChatMessage(role="user", content="Hi")])   # itself: it was refused
    assert reply.message.content and not llm.get_tool_calls_from_response(reply, error_on_no_tool_call=False)


def test_a_reply_that_is_only_tool_calls_goes_back_as_the_model_wrote_it():
    """KVBoost's reply holds an empty TextBlock before its ToolCallBlock; sent back as a part of its own it
    put "\n\n" before the call, text the model never wrote (its 34 tokens recomputed every step)."""
    block = ToolCallBlock(tool_call_id="call_abc", tool_name="f", tool_kwargs={"x": 1})
    reply = ChatMessage(role="assistant", blocks=[TextBlock(text=""), block])
    alone = ChatMessage(role="assistant", blocks=[block])
    assert to_engine_messages([reply]) == to_engine_messages([alone])
    assert to_engine_messages([reply])[0]["content"].startswith("<tool_call>")


def test_a_tool_whose_parameters_are_not_an_object_is_refused():
    """A forced call to {"type": "string"} parameters came back as text, no call, finish_reason "stop"."""
    from kvboost_engine.errors import InputError
    from kvboost_engine.toolcalls import forced_tools
    tool = {"type": "function", "function": {"name": "s", "parameters": {"type": "string"}}}
    with pytest.raises(InputError, match="tool 's': parameters must be an object schema"):
        forced_tools([tool], "any")
    ok = {"type": "function", "function": {"name": "t", "parameters": {"properties": {}}}}
    assert forced_tools([ok], "any") == {"t": {"properties": {}}}
