"""ChatKVBoost / KVBoostLLM behaviour: the complaints about other HF wrappers, one test each."""
import json
import time
from typing import Annotated, Literal

import pytest

pytest.importorskip("langchain_core")

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

from holds import Hold  # noqa: E402
from kvboost_engine import Engine, Generation  # noqa: E402
from kvboost_integrations.langchain import ChatKVBoost, KVBoostLLM, document_block  # noqa: E402
from kvboost_integrations.langchain.reply import ChatReply as _Reply  # noqa: E402
from kvboost_integrations.langchain.messages import to_engine_messages  # noqa: E402
from kvboost_integrations._toolcalls import HERMES, ToolCallSplitter  # noqa: E402
from kvboost_integrations.langchain.tools import parse_tool_calls  # noqa: E402

QUESTION = "Name three colours of the rainbow."


@pytest.fixture(scope="module")
def lc_engine(smol):
    model, tokenizer = smol
    return Engine(model, tokenizer, cache_bytes=256 * 2**20, model_name="SmolLM2-135M-Instruct")


@pytest.fixture
def chat(lc_engine):
    return ChatKVBoost(engine=lc_engine, max_tokens=12)


def test_invoke_returns_reply_only_with_usage_and_reuse_telemetry(chat, lc_engine):
    first = chat.invoke(QUESTION)
    second = chat.invoke(QUESTION)
    assert first.content == second.content and QUESTION not in first.content
    prompt_tokens = lc_engine.count_tokens([{"role": "user", "content": QUESTION}])
    usage = second.usage_metadata
    assert usage["input_tokens"] == prompt_tokens
    assert usage["total_tokens"] == prompt_tokens + usage["output_tokens"]
    meta = second.response_metadata
    assert meta["model_name"] == "SmolLM2-135M-Instruct"
    assert meta["finish_reason"] in ("stop", "length")
    assert meta["reused_tokens"] == meta["reused_exact"] == prompt_tokens - 1   # all but the last token
    assert usage["input_token_details"]["cache_read"] == meta["reused_tokens"]
    assert meta["ttft_s"] > 0


def test_stream_matches_invoke_and_reports_usage_once(chat):
    chunks = list(chat.stream(QUESTION))
    assert "".join(c.content for c in chunks) == chat.invoke(QUESTION).content
    assert len(chunks) > 2                                     # really streamed, token by token
    assert [c.usage_metadata is not None for c in chunks].count(True) == 1
    assert chunks[-1].chunk_position == "last" and chunks[-1].response_metadata["model_name"]


@pytest.mark.parametrize("where", ["call", "instance"])
def test_stop_strings_of_any_length_cut_the_reply(lc_engine, where):
    full = ChatKVBoost(engine=lc_engine, max_tokens=16).invoke(QUESTION).content
    stop = full[4:17]                                          # a multi-token stop string mid-reply
    assert len(stop) > 8
    if where == "call":
        cut = ChatKVBoost(engine=lc_engine, max_tokens=16).invoke(QUESTION, stop=[stop])
    else:
        cut = ChatKVBoost(engine=lc_engine, max_tokens=16, stop=["never there", stop]).invoke(QUESTION)
    assert cut.content == full[:full.index(stop)]
    assert cut.response_metadata["finish_reason"] == "stop"


def test_engine_is_lazy_and_shared_between_models_with_same_settings(monkeypatch):
    loads = []

    def fake_load(model=None, **options):
        loads.append((model, options))
        return object()

    monkeypatch.setattr(Engine, "from_pretrained", staticmethod(fake_load))
    a = ChatKVBoost(model="lazy-share-test/model", cache_bytes=12345)
    b = KVBoostLLM(model="lazy-share-test/model", cache_bytes=12345)
    c = ChatKVBoost(model="lazy-share-test/model", cache_bytes=999)
    assert loads == []                                         # nothing loads at construction
    assert a.get_engine() is b.get_engine() is a.get_engine()
    assert c.get_engine() is not a.get_engine()
    assert loads == [("lazy-share-test/model", {"cache_bytes": 12345}), ("lazy-share-test/model", {"cache_bytes": 999})]


def test_bad_input_is_rejected_clearly(chat):
    with pytest.raises(ValueError, match="unsupported call parameters"):
        chat.invoke("hi", best_of=2)
    with pytest.raises(ValueError, match="text only"):
        chat.invoke([HumanMessage([{"type": "image", "url": "http://x/y.png"}])])


@pytest.mark.parametrize("block, match", [
    ({"type": "text"}, r"content block 1 is a text block without a 'text' string: \{'type': 'text'\}"),
    ({"type": "text", "text": None}, "content block 1 is a text block without a 'text' string"),
    ({"type": "text", "text": 5}, "content block 1 is a text block without a 'text' string"),
])
def test_a_malformed_text_block_is_an_error_naming_it(chat, lc_engine, block, match):
    with pytest.raises(ValueError, match=match):
        chat.invoke([HumanMessage(["Say hi.", block])])
    expected = lc_engine.chat([{"role": "user", "content": [{"type": "text", "text": "Say hi."}]}], max_new_tokens=12)
    assert chat.invoke([HumanMessage(["Say hi."])]).content == expected.text     # still answers


def test_timeout_stops_generation(lc_engine):
    slow = ChatKVBoost(engine=lc_engine, max_tokens=200, timeout=0.05)
    before = lc_engine.stats()["generated_tokens"]
    with pytest.raises(TimeoutError):
        slow.invoke("Write a long story about a dragon.")
    assert lc_engine.stats()["generated_tokens"] - before < 20


def test_messages_become_one_part_per_block_and_documents_are_marked():
    messages = [SystemMessage("Be brief."),
                HumanMessage([document_block("Doc one."), document_block("Doc two."), {"type": "text", "text": "Q?"}]),
                AIMessage("", tool_calls=[{"name": "f", "args": {"a": 1}, "id": "c1"}]),
                ToolMessage("2", tool_call_id="c1", name="f")]
    as_text = to_engine_messages(messages, native_tools=False)
    assert as_text[1]["content"] == [{"type": "document", "text": "Doc one."},
                                     {"type": "document", "text": "Doc two."}, {"type": "text", "text": "Q?"}]
    assert as_text[2]["content"] == '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    assert as_text[3] == {"role": "tool", "content": "2"}
    native = to_engine_messages(messages, native_tools=True)
    assert native[2]["tool_calls"][0]["function"] == {"name": "f", "arguments": {"a": 1}}
    assert native[3]["tool_call_id"] == native[2]["tool_calls"][0]["id"]
    assert len(native[3]["tool_call_id"]) == 9 and native[3]["tool_call_id"].isalnum()    # Mistral's rule


def test_streamed_tool_calls_are_held_back_and_parsed():
    reply = _Reply("m")
    reply.splitter = ToolCallSplitter(HERMES)
    deltas = ["Sure. <tool", '_call>\n{"name": "f", "arguments"', ': {"a": 1}}\n</tool_call>']
    chunks = [reply.chunk(d) for d in deltas] + [reply.chunk(Generation(finish_reason="stop"))]
    total = None
    for chunk in filter(None, chunks):
        total = chunk.message if total is None else total + chunk.message
    assert total.content.strip() == "Sure."
    assert [(c["name"], c["args"]) for c in total.tool_calls] == [("f", {"a": 1})]
    assert total.response_metadata["finish_reason"] == "tool_calls"
    assert parse_tool_calls("<tool_call>{bad json</tool_call>", HERMES)[1][0]["name"] is None
    cut = _Reply("m")
    cut.splitter = ToolCallSplitter(HERMES)
    cut.chunk('<tool_call>\n{"name": "f", "arguments": {"a": 1')
    last = cut.chunk(Generation(finish_reason="length")).message       # max_tokens cut the call short
    assert last.tool_call_chunks == [] and last.content.startswith("<tool_call>")
    assert last.response_metadata["finish_reason"] == "length"
    plain = ToolCallSplitter(None)
    assert plain.feed("a <tool_call>") == "a <tool_call>"


class Pet(BaseModel):
    name: str = Field(description="the pet's name", max_length=20)
    kind: Literal["cat", "dog", "bird"]
    age: int = Field(ge=0, le=30)
    vaccinated: bool
    # bounded: left open, the greedy 135M model repeats items (or words in a string) until max_tokens
    toys: list[Annotated[str, Field(max_length=12)]] = Field(max_length=3)


def test_structured_output_is_valid_for_a_rich_schema(lc_engine):
    llm = ChatKVBoost(engine=lc_engine, max_tokens=80)
    pet = llm.with_structured_output(Pet).invoke("Describe a pet cat called Tom, aged 3, who loves balls.")
    assert isinstance(pet, Pet) and 0 <= pet.age <= 30
    raw = llm.with_structured_output(Pet.model_json_schema(), include_raw=True).invoke("Describe a dog.")
    assert raw["parsing_error"] is None and set(raw["parsed"]) == set(Pet.model_fields)
    assert json.loads(raw["raw"].content) == raw["parsed"]


def test_structured_output_through_a_forced_tool_call(lc_engine):
    class Answer(BaseModel):
        """An answer with a confidence."""
        answer: str
        confident: bool

    llm = ChatKVBoost(engine=lc_engine, max_tokens=60)
    result = llm.with_structured_output(Answer, method="function_calling").invoke("Is the sky blue?")
    assert isinstance(result, Answer)
    with pytest.raises(ValueError, match="method"):
        llm.with_structured_output(Answer, method="xml")


def test_a_token_budget_that_runs_out_is_reported_not_hidden(lc_engine):
    llm = ChatKVBoost(engine=lc_engine, max_tokens=3)
    raw = llm.with_structured_output(Pet, include_raw=True).invoke("Describe a pet.")
    assert raw["raw"].response_metadata["finish_reason"] == "length"
    assert raw["parsed"] is None and raw["parsing_error"] is not None
    assert raw["raw"].content.startswith("{")


def test_forced_tool_call_picks_among_tools_and_fills_arguments(lc_engine):
    def get_weather(city: str) -> str:
        """Weather in a city."""
        return "sunny"

    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    llm = ChatKVBoost(engine=lc_engine, max_tokens=40).bind_tools([get_weather, add], tool_choice="add")
    message = llm.invoke("What is 2 plus 5?")
    assert message.content == "" and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call["name"] == "add" and set(call["args"]) == {"a", "b"}
    assert all(isinstance(v, int) for v in call["args"].values())


def test_completion_llm_continues_without_echo_and_reports_usage(lc_engine):
    llm = KVBoostLLM(engine=lc_engine, max_tokens=8)
    prompt = "The capital city of France is"
    result = llm.generate([prompt])
    generation = result.generations[0][0]
    assert not generation.text.startswith(prompt)
    assert generation.text == "".join(llm.stream(prompt))
    info = generation.generation_info
    assert info["usage_metadata"]["input_tokens"] == lc_engine.count_tokens(prompt)
    assert info["finish_reason"] in ("stop", "length") and info["model_name"] == "SmolLM2-135M-Instruct"
    assert llm.invoke(prompt, stop=[generation.text[2:6]]) == generation.text[:generation.text.index(generation.text[2:6])]


TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_tool_aware_templates_receive_tools_and_calls_natively(smol, monkeypatch):
    from transformers import AutoTokenizer

    from kvboost_engine.loading import default_model_dir

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    tokenizer.chat_template = TOOL_TEMPLATE
    engine = Engine(smol[0], tokenizer, cache_bytes=64 * 2**20)
    calls = []
    original = Engine.stream_chat

    def spy(self, messages, **params):
        calls.append((messages, params.get("template_kwargs")))
        return original(self, messages, **params)

    monkeypatch.setattr(Engine, "stream_chat", spy)

    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    history = [HumanMessage("What is 1 + 2?"), AIMessage("", tool_calls=[{"name": "add", "args": {"a": 1, "b": 2},
                                                                          "id": "c1"}]),
               ToolMessage("3", tool_call_id="c1")]
    ChatKVBoost(engine=engine, max_tokens=2).bind_tools([add]).invoke(history)
    messages, template_kwargs = calls[0]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]     # no tool prompt of ours
    assert template_kwargs["tools"][0]["function"]["name"] == "add"
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2}
    rendered = tokenizer.decode(engine.encode_messages(messages, **template_kwargs).token_ids)
    assert 'Tools: [{"type": "function"' in rendered and '<tool_call>{"name": "add"' in rendered
    forced = ChatKVBoost(engine=engine, max_tokens=40).bind_tools([add], tool_choice="any").invoke("Add 4 and 5.")
    assert forced.tool_calls[0]["name"] == "add" and set(forced.tool_calls[0]["args"]) == {"a", "b"}


def test_the_hf_wrappers_argument_names_are_refused_with_a_hint():
    """`model_id` is what ChatHuggingFace/HuggingFacePipeline take: an error naming `model`, not a
    silently loaded default model."""
    with pytest.raises(ValueError, match=r"unexpected argument 'model_id'; did you mean 'model'\?.*Accepted:.*engine_kwargs"):
        ChatKVBoost(model_id="x")


def test_engine_options_beside_engine_are_refused_and_the_cache_key_tells_configurations_apart(lc_engine):
    for option in (dict(dtype="bfloat16"), dict(moved_reuse="blend"), dict(engine_kwargs={"weights": "int4"})):
        with pytest.raises(ValueError, match="with engine="):
            ChatKVBoost(engine=lc_engine, **option)
    keys = {ChatKVBoost()._get_llm_string(), ChatKVBoost(dtype="bfloat16")._get_llm_string(),
            ChatKVBoost(moved_reuse="blend")._get_llm_string(), ChatKVBoost(engine_kwargs={"weights": "int4"})._get_llm_string(),
            ChatKVBoost(document_order="cache")._get_llm_string(), ChatKVBoost(reasoning=True)._get_llm_string(),
            ChatKVBoost(engine=lc_engine)._get_llm_string()}
    assert len(keys) == 7                                       # none loads a model (engines load on first use)
    assert KVBoostLLM(dtype="bfloat16").dict() != KVBoostLLM().dict()       # BaseLLM's cache key
    assert ChatKVBoost(dtype="bfloat16")._get_llm_string() == ChatKVBoost(dtype="bfloat16")._get_llm_string()
    assert lc_engine.fingerprint.hex() in ChatKVBoost(engine=lc_engine)._get_llm_string()
    blend = Engine(lc_engine.model, lc_engine.tokenizer, moved_reuse="blend")    # same weights, other options
    assert ChatKVBoost(engine=blend)._get_llm_string() != ChatKVBoost(engine=lc_engine)._get_llm_string()
    blend.close()
    assert ChatKVBoost(engine=lc_engine, engine_kwargs={}).engine is lc_engine     # an empty dict says nothing
    counted = ChatKVBoost(engine=lc_engine, timeout=5).get_num_tokens_from_messages([HumanMessage("Hi")])
    assert counted == ChatKVBoost(engine=lc_engine).get_num_tokens_from_messages([HumanMessage("Hi")]) > 1


def test_timeout_covers_the_wait_before_the_first_token(lc_engine):
    hold = Hold(at=1)                              # another request holds the scheduler thread at its first token
    busy = lc_engine.stream_chat([{"role": "user", "content": "Hi"}], constraint=hold, max_new_tokens=2)
    try:
        assert hold.reached.wait(30)
        for llm in (ChatKVBoost(engine=lc_engine, max_tokens=4, timeout=0.3),
                    KVBoostLLM(engine=lc_engine, max_tokens=4, timeout=0.3)):
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                llm.invoke("Hello")                # no token can come: only the engine's own bound ends the wait
            assert time.monotonic() - started < 10
    finally:
        hold.release.set()
        busy.close()


def test_a_v1_history_with_a_call_that_did_not_parse_converts():
    call = {"type": "invalid_tool_call", "id": "c1", "name": "get_weather", "args": "{bad", "error": None}
    bad = AIMessage(content=[{"type": "text", "text": "Let me look."}, call], invalid_tool_calls=[call])
    converted = to_engine_messages([HumanMessage("Weather?"), bad], native_tools=False)
    assert converted[1]["role"] == "assistant" and "Let me look." in json.dumps(converted[1]["content"])
