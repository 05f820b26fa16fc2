"""KVBoost as a LlamaIndex FunctionCallingLLM: forced and parsed tool calls, predict_and_call, a
FunctionAgent running a two-tool task, structured_predict through the schema constraint.

SmolLM2-135M does not decide to call tools on its own, so where the agent needs a call it is
forced (tool_choice); the calls' arguments are still the model's, under the tool's schema."""

import asyncio
import json
from typing import Annotated, Literal, Optional

import pytest

pytest.importorskip("llama_index.core")

from llama_index.core.agent.workflow import FunctionAgent, ToolCallResult  # noqa: E402
from llama_index.core.base.llms.types import ChatMessage, MessageRole, ToolCallBlock  # noqa: E402
from llama_index.core.prompts import PromptTemplate  # noqa: E402
from llama_index.core.tools import FunctionTool  # noqa: E402
from pydantic import BaseModel, Field, create_model  # noqa: E402

from kvboost_engine import Engine, Generation  # noqa: E402
from kvboost_integrations._toolcalls import HERMES  # noqa: E402
from kvboost_integrations.llama_index import KVBoost, to_engine_messages  # noqa: E402
from kvboost_integrations.llama_index.calls import ResponseShaper  # noqa: E402


def get_temperature(city: Literal["Paris", "London", "Tokyo"]) -> int:
    """Current temperature in a city, in degrees Celsius."""
    return {"Paris": 21, "London": 15, "Tokyo": 26}[city]


def to_fahrenheit(celsius: int) -> float:
    """Convert degrees Celsius to Fahrenheit."""
    return celsius * 9 / 5 + 32


TOOLS = [FunctionTool.from_defaults(get_temperature), FunctionTool.from_defaults(to_fahrenheit)]


@pytest.fixture(scope="module")
def tools_engine(smol):
    return Engine(*smol, cache_bytes=128 * 2**20)


@pytest.fixture
def llm(tools_engine):
    return KVBoost(engine=tools_engine, max_new_tokens=48)


def test_a_forced_call_comes_back_as_a_tool_selection(llm):
    assert llm.metadata.is_function_calling_model
    response = llm.chat_with_tools(TOOLS, user_msg="What is the temperature in Paris?", tool_required=True)
    calls = llm.get_tool_calls_from_response(response)
    assert len(calls) == 1 and calls[0].tool_name in ("get_temperature", "to_fahrenheit")
    named = llm.chat_with_tools(TOOLS, user_msg="What is the temperature in Paris?", tool_choice="get_temperature")
    selection = llm.get_tool_calls_from_response(named)[0]
    assert selection.tool_name == "get_temperature" and selection.tool_kwargs["city"] in ("Paris", "London", "Tokyo")
    assert named.raw["kvboost"]["finish_reason"] == "stop" and named.message.content == ""
    free = llm.chat_with_tools(TOOLS, user_msg="Say hello.")     # "auto": the small model just answers
    assert llm.get_tool_calls_from_response(free, error_on_no_tool_call=False) == []
    with pytest.raises(ValueError, match="expected at least one tool call"):
        llm.get_tool_calls_from_response(free)


def test_predict_and_call_runs_the_chosen_tool(llm):
    result = llm.predict_and_call(TOOLS, "What is the temperature in Tokyo?", tool_choice="get_temperature")
    source = result.sources[0]
    assert source.tool_name == "get_temperature" and not source.is_error
    assert result.response == str(get_temperature(**source.raw_input["kwargs"]))
    again = asyncio.run(llm.apredict_and_call(TOOLS, "Convert 20 C.", tool_choice="to_fahrenheit"))
    assert again.sources[0].tool_name == "to_fahrenheit" and float(again.response) == to_fahrenheit(
        **again.sources[0].raw_input["kwargs"])


class ScriptedToolChoice(KVBoost):
    """Forces the agent's k-th call to script[k] (the 135M model does not pick tools on its own);
    after the script, tool_choice is "none" and the model answers."""

    script: list = Field(default_factory=list)

    def _prepare_chat_with_tools(self, tools, user_msg=None, chat_history=None, verbose=False,
                                 allow_parallel_tool_calls=False, tool_required=False, tool_choice=None, **kwargs):
        turn = sum(1 for message in chat_history or [] if message.role == MessageRole.TOOL)
        choice = self.script[turn] if turn < len(self.script) else "none"
        return super()._prepare_chat_with_tools(tools, user_msg, chat_history, verbose, allow_parallel_tool_calls,
                                                tool_choice=choice, **kwargs)


@pytest.mark.parametrize("streaming", [True, False])
def test_function_agent_runs_a_two_tool_task_end_to_end(tools_engine, streaming):
    llm = ScriptedToolChoice(engine=tools_engine, max_new_tokens=48, script=["get_temperature", "to_fahrenheit"])
    agent = FunctionAgent(tools=TOOLS, llm=llm, streaming=streaming,
                          system_prompt="You answer weather questions with the tools.")

    async def run():
        handler = agent.run(user_msg="What is the temperature in Paris, in Fahrenheit?")
        results = [event async for event in handler.stream_events() if isinstance(event, ToolCallResult)]
        return results, await handler

    results, final = asyncio.run(run())
    assert [r.tool_name for r in results] == ["get_temperature", "to_fahrenheit"]
    assert results[0].tool_output.content == str(get_temperature(**results[0].tool_kwargs))
    assert results[1].tool_output.content == str(to_fahrenheit(**results[1].tool_kwargs))
    assert final.response.role == MessageRole.ASSISTANT and isinstance(final.response.content, str)
    assert [call.tool_name for call in final.tool_calls] == ["get_temperature", "to_fahrenheit"]


def test_auto_replies_are_parsed_into_tool_call_blocks():
    class Call:                                   # a started call whose template writes Hermes calls
        format = HERMES
        inside = None                             # no thinking separated

        def telemetry(self, gen):
            return {"finish_reason": gen.finish_reason}

    shaper = ResponseShaper(Call())
    deltas = ["Let me check. <tool", '_call>\n{"name": "get_temperature", ', '"arguments": {"city": "Paris"}}\n</tool_call>']
    responses = [shaper.chat(d) for d in deltas] + [shaper.chat(Generation(text="", finish_reason="stop"))]
    assert "".join(r.delta for r in responses).strip() == "Let me check."
    blocks = [b for b in responses[-1].message.blocks if isinstance(b, ToolCallBlock)]
    assert [(b.tool_name, b.tool_kwargs) for b in blocks] == [("get_temperature", {"city": "Paris"})]


def test_tool_histories_become_engine_messages():
    call = ChatMessage(role=MessageRole.ASSISTANT, blocks=[ToolCallBlock(tool_call_id="call_abc", tool_name="f",
                                                                         tool_kwargs={"x": 1})])
    result = ChatMessage(role=MessageRole.TOOL, content="2", additional_kwargs={"tool_call_id": "call_abc"})
    as_text = to_engine_messages([call, result])
    assert as_text[0]["content"] == '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    native = to_engine_messages([call, result], native_tools=True)
    assert native[0]["tool_calls"][0]["function"] == {"name": "f", "arguments": {"x": 1}}
    assert native[1]["tool_call_id"] == native[0]["tool_calls"][0]["id"]


def _schemas() -> list[type[BaseModel]]:
    """20 small output classes: enums, bounded numbers, booleans, optional and nested fields, lists."""
    Colour = Literal["red", "green", "blue"]
    Short = Annotated[str, Field(max_length=12)]
    Place = create_model("Place", city=(Literal["Paris", "Rome", "Oslo"], ...), rating=(Annotated[int, Field(ge=1, le=5)], ...))
    pool = [("colour", Colour), ("count", Annotated[int, Field(ge=0, le=20)]), ("ok", bool),
            ("price", Annotated[float, Field(ge=0, le=100)]), ("label", Short), ("note", Optional[Short]),
            ("tags", Annotated[list[Colour], Field(max_length=3)]), ("place", Place),
            ("level", Literal[1, 2, 3]), ("size", Optional[Literal["S", "M", "L"]])]
    return [create_model(f"Answer{k}", **{name: (kind, ...) for name, kind in (pool[k % 10], pool[(k * 3 + 1) % 10],
                                                                            pool[(k * 7 + 2) % 10])})
            for k in range(20)]


def test_structured_predict_returns_valid_objects_for_20_schemas(tools_engine):
    llm = KVBoost(engine=tools_engine, max_new_tokens=64)
    prompt = PromptTemplate("Fill in the answer about {topic}.")
    for index, output_cls in enumerate(_schemas()):
        result = llm.structured_predict(output_cls, prompt, topic=f"a shop, item {index}")
        assert isinstance(result, output_cls)
    assert isinstance(asyncio.run(llm.astructured_predict(output_cls, prompt, topic="a park")), output_cls)


def test_structured_predict_cut_short_says_so(tools_engine):
    class Story(BaseModel):
        title: str
        text: str

    with pytest.raises(ValueError, match="max_new_tokens"):
        KVBoost(engine=tools_engine, max_new_tokens=4).structured_predict(Story, PromptTemplate("A story."))


def test_streamed_structured_output_builds_the_object_structured_predict_gives(tools_engine):
    class Person(BaseModel):
        name: str
        age: int

    llm = KVBoost(engine=tools_engine, max_new_tokens=60)
    prompt = PromptTemplate("Extract: {text}")
    whole = llm.structured_predict(Person, prompt, text="John is 30.")
    streamed = list(llm.stream_structured_predict(Person, prompt, text="John is 30."))
    assert len(streamed) > 2 and streamed[-1] == whole and isinstance(streamed[-1], Person)
    assert any(getattr(partial, "age", None) is None for partial in streamed[:-1])     # partial objects first
    known = [sum(value is not None for value in partial.model_dump().values()) for partial in streamed]
    assert known == sorted(known)                 # never a blank object between two readable ones

    async def collect():
        return [item async for item in await llm.astream_structured_predict(Person, prompt, text="John is 30.")]

    assert asyncio.run(collect())[-1] == whole
    chat = list(llm.as_structured_llm(Person).stream_chat([ChatMessage(role="user", content="John is 30.")]))
    assert chat[-1].raw == whole
    with pytest.raises(ValueError, match="max_new_tokens"):
        list(KVBoost(engine=tools_engine, max_new_tokens=4).stream_structured_predict(Person, prompt, text="x"))


def test_a_reply_with_calls_lists_them_where_llama_index_core_looks(llm):
    response = llm.chat_with_tools(TOOLS, user_msg="What is the temperature in Paris?", tool_choice="get_temperature")
    block = next(b for b in response.message.blocks if isinstance(b, ToolCallBlock))
    [call] = response.message.additional_kwargs["tool_calls"]
    assert call["id"] == block.tool_call_id and call["function"]["name"] == "get_temperature"
    assert json.loads(call["function"]["arguments"]) == block.tool_kwargs
    assert to_engine_messages([response.message], native_tools=True)[0]["tool_calls"].__len__() == 1   # once


def test_keeping_the_first_call_trims_both_lists():
    from llama_index.core.base.llms.types import ChatResponse

    from kvboost_integrations.llama_index.tools import keep_first_call

    blocks = [ToolCallBlock(tool_call_id=f"c{i}", tool_name="get_temperature", tool_kwargs={"city": "Paris"})
              for i in range(2)]
    listed = [{"id": f"c{i}", "type": "function", "function": {"name": "get_temperature", "arguments": "{}"}}
              for i in range(2)]
    response = keep_first_call(ChatResponse(message=ChatMessage(role="assistant", blocks=blocks,
                                                                additional_kwargs={"tool_calls": listed})))
    assert [b.tool_call_id for b in response.message.blocks if isinstance(b, ToolCallBlock)] == ["c0"]
    assert [c["id"] for c in response.message.additional_kwargs["tool_calls"]] == ["c0"]
