"""Tool calls in each family's own format, on tiny random models with their real chat templates
(Qwen2.5 Hermes-style, Llama 3.1 JSON, Mistral v3 [TOOL_CALLS]): what the template writes for a
call is what we parse ("auto"), and forced calls are generated in it (constrained)."""
import json

import pytest

pytest.importorskip("langchain_core")

from langchain_core.messages import AIMessage, HumanMessage, ToolMessage  # noqa: E402

from kvboost_integrations._toolcalls import HERMES, ToolCallSplitter, tool_format  # noqa: E402
from kvboost_integrations.langchain import ChatKVBoost  # noqa: E402
from tool_families import EXPECTED_FORMAT, FAMILIES, family_engine, family_tokenizer  # noqa: E402

ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
ASK = [{"role": "user", "content": "What is 1 + 2?"}]


BOUNDED_ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"]}}}        # bounded: a random model would write digits until max_tokens


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def template_reply(tokenizer, call_args: dict) -> str:
    """What the real template writes after the generation prompt for one assistant tool call."""
    prompt = tokenizer.apply_chat_template(ASK, tools=[ADD], tokenize=False, add_generation_prompt=True)
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "abcdefghi", "type": "function", "function": {"name": "add", "arguments": call_args}}]}
    rendered = tokenizer.apply_chat_template([*ASK, call], tools=[ADD], tokenize=False)
    assert rendered.startswith(prompt)
    return rendered[len(prompt):].split(tokenizer.eos_token)[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_what_the_template_writes_for_a_call_is_parsed_back(family):
    tokenizer = family_tokenizer(family)
    fmt = tool_format(tokenizer)
    assert fmt.name == EXPECTED_FORMAT[family] and fmt.native
    reply = template_reply(tokenizer, {"a": 1, "b": 2})
    content, calls = fmt.parse("Let me add. " + reply if family != "llama" else reply)
    assert [(c["name"], json.loads(c["args"])) for c in calls] == [("add", {"a": 1, "b": 2})]
    assert content in ("", "Let me add.")
    splitter = ToolCallSplitter(fmt)                 # streamed: nothing of the call leaks as text
    shown = "".join(splitter.feed(reply[i:i + 3]) for i in range(0, len(reply), 3))
    rest, streamed_calls = splitter.finish()
    assert shown + rest == "" and [c["name"] for c in streamed_calls] == ["add"]


def test_plain_answers_are_not_taken_for_calls():
    llama = tool_format(family_tokenizer("llama"))
    assert llama.parse('{"answer": 3}') == ('{"answer": 3}', [])
    assert llama.parse("It is 3.") == ("It is 3.", [])
    cut = llama.parse('{"name": "add", "parameters": {"a": 12')[1]          # max_tokens cut a call short
    assert cut[0]["name"] == "add" and cut[0]["args"].startswith('{"name"')
    assert llama.parse('{"name": "Alice", "age": 30}') == ('{"name": "Alice", "age": 30}', [])    # an answer
    assert HERMES.parse("No tools needed.") == ("No tools needed.", [])
    stray = HERMES.parse('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}}\n</tool_call>')[1]
    assert [(c["name"], json.loads(c["args"])) for c in stray] == [("add", {"a": 1, "b": 2})]   # junk after it
    calls = tool_format(family_tokenizer("mistral")).parse('[TOOL_CALLS] [{"name": "a", "arguments": {}}, '
                                                           '{"name": "b", "arguments": {"x": 1}}]')[1]
    assert [c["name"] for c in calls] == ["a", "b"]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_chat(request):
    engine = family_engine(request.param)
    return request.param, engine, ChatKVBoost(engine=engine, max_tokens=48)


def test_forced_calls_are_written_in_the_family_format(family_chat):
    family, engine, chat = family_chat
    message = chat.bind_tools([BOUNDED_ADD], tool_choice="any").invoke("What is 1 + 2?")
    assert len(message.tool_calls) == 1 and message.tool_calls[0]["name"] == "add"
    assert set(message.tool_calls[0]["args"]) == {"a", "b"}
    assert all(isinstance(v, int) for v in message.tool_calls[0]["args"].values())
    assert message.response_metadata["finish_reason"] == "tool_calls"
    streamed = None
    for chunk in chat.bind_tools([BOUNDED_ADD], tool_choice="add").stream("What is 1 + 2?"):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed.tool_calls[0]["name"] == "add" and streamed.content == ""
    fmt = tool_format(engine.tokenizer)
    raw = engine.chat(ASK, template_kwargs={"tools": [ADD]}, constraint=fmt.forced_call({"add": {}}),
                      skip_special_tokens=False, max_new_tokens=48)
    assert raw.text.startswith(fmt.prefix.strip() or "{")
    if family == "mistral":                          # the marker is the special token itself
        assert raw.token_ids[0] == engine.tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")


def test_tool_histories_render_natively(family_chat):
    family, engine, chat = family_chat
    history = [HumanMessage("What is 1 + 2?"),
               AIMessage("", tool_calls=[{"name": "add", "args": {"a": 1, "b": 2}, "id": "call_123456789abcdef"}]),
               ToolMessage("3", tool_call_id="call_123456789abcdef")]
    reply = ChatKVBoost(engine=engine, max_tokens=2).bind_tools([add]).invoke(history)
    assert reply.response_metadata["prompt_tokens"] > 0     # Mistral's template accepted the ids


def test_two_tools_of_one_name_are_refused_for_a_forced_call():
    from kvboost_engine import InputError
    from kvboost_engine.toolcalls import forced_tools

    with pytest.raises(InputError, match="two tools are named 'add'"):
        forced_tools([ADD, BOUNDED_ADD], "any")
