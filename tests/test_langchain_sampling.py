"""Sampling controls and logprobs through ChatKVBoost and KVBoostLLM: each control reaches the
engine and shows its effect, logprobs land where ChatOpenAI puts them (streamed too), every
argument is honoured or refused where it is given, and KVBoostLLM.generate batches its prompts."""
import pytest

pytest.importorskip("langchain_core")

import torch  # noqa: E402
from langchain_core.messages import HumanMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from pydantic import ValidationError  # noqa: E402

from kvboost_engine import Engine, ForwardEvent  # noqa: E402
from kvboost_integrations._toolcalls import HERMES  # noqa: E402
from kvboost_integrations.langchain import ChatKVBoost, KVBoostLLM  # noqa: E402
from kvboost_integrations.langchain.reply import ChatReply as _Reply  # noqa: E402
from kvboost_engine import Generation  # noqa: E402
from kvboost_integrations._toolcalls import ToolCallSplitter  # noqa: E402

NUMBERS = "List the numbers."          # SmolLM2 counts on greedily: "1, 2, 3, 4, ..."
HELLO = "Say hello."
CHAT = lambda text: [{"role": "user", "content": text}]  # noqa: E731


@pytest.fixture(scope="module")
def lc_engine(smol):
    model, tokenizer = smol
    return Engine(model, tokenizer, cache_bytes=64 * 2**20, model_name="SmolLM2-135M-Instruct")


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return "sunny"


@pytest.mark.parametrize("control", [{"repetition_penalty": 1.5}, {"frequency_penalty": 1.0},
                                     {"presence_penalty": 1.5}])
def test_penalties_reach_the_engine_and_change_the_reply(lc_engine, control):
    plain = ChatKVBoost(engine=lc_engine, max_tokens=40).invoke(NUMBERS).content
    from_field = ChatKVBoost(engine=lc_engine, max_tokens=40, **control).invoke(NUMBERS).content
    per_call = ChatKVBoost(engine=lc_engine, max_tokens=40).invoke(NUMBERS, **control).content
    assert from_field == per_call == lc_engine.chat(CHAT(NUMBERS), max_new_tokens=40, **control).text
    if "presence_penalty" not in control:               # presence alone does not break a count (each number is new)
        assert from_field != plain


def test_min_tokens_and_logit_bias_reach_the_engine(lc_engine):
    plain = ChatKVBoost(engine=lc_engine, max_tokens=60).invoke(HELLO)
    assert plain.response_metadata["finish_reason"] == "stop"
    longer = ChatKVBoost(engine=lc_engine, max_tokens=60, min_tokens=50).invoke(HELLO)
    assert longer.usage_metadata["output_tokens"] >= 50 > plain.usage_metadata["output_tokens"]
    banana = lc_engine.tokenizer(" banana", add_special_tokens=False)["input_ids"][0]
    biased = ChatKVBoost(engine=lc_engine, max_tokens=3, logit_bias={banana: 100}).invoke(HELLO)
    assert biased.content.startswith(" banana") or biased.content.startswith("banana")


def test_logprobs_in_chatopenai_format_equal_the_engines_log_softmax(lc_engine):
    chat = ChatKVBoost(engine=lc_engine, max_tokens=12, logprobs=True, top_logprobs=2)
    reply = chat.invoke(HELLO)
    content = reply.response_metadata["logprobs"]["content"]
    assert "".join(entry["token"] for entry in content) == reply.content and len(content) == 12
    expected = torch.log_softmax(lc_engine.next_token_logits(messages=CHAT(HELLO)), -1)
    first = content[0]
    assert first["logprob"] == pytest.approx(float(expected[first["token_id"]]), abs=1e-5)
    assert set(first) >= {"token", "bytes", "logprob", "top_logprobs"} and len(first["top_logprobs"]) == 2
    streamed = list(chat.stream(HELLO))
    assert sum(1 for c in streamed if c.response_metadata.get("logprobs")) > 2      # on the chunks as they come
    total = streamed[0]
    for chunk in streamed[1:]:
        total += chunk
    assert total.response_metadata["logprobs"]["content"] == content
    assert "logprobs" not in ChatKVBoost(engine=lc_engine, max_tokens=4).invoke(HELLO).response_metadata


def test_logprobs_of_text_held_back_for_a_tool_call_reach_the_final_chunk():
    class Delta(str):
        logprobs = None

    def delta(text, n):
        d = Delta(text)
        d.logprobs = [{"token": f"t{n}", "logprob": -1.0}]
        return d

    reply = _Reply("m")
    reply.splitter = ToolCallSplitter(HERMES)
    chunks = [reply.chunk(delta("Sure. ", 0)), reply.chunk(delta("<tool_", 1)), reply.chunk(delta("call>", 2))]
    gen = Generation(text="", finish_reason="stop", logprobs=[{"token": f"t{n}", "logprob": -1.0} for n in range(3)])
    final = reply.chunk(gen)
    sent = [e["token"] for c in chunks + [final] if c is not None for e in c.message.response_metadata.get(
        "logprobs", {}).get("content", [])]
    assert sent == ["t0", "t1", "t2"]


def test_completion_llm_puts_logprobs_in_generation_info_and_batches_with_usage(lc_engine):
    llm = KVBoostLLM(engine=lc_engine, max_tokens=8, logprobs=True)
    prompts = ["The capital of France is", "Two plus two is", "The colour of the sky is"]
    alone = [llm.generate([p]).generations[0][0] for p in prompts]
    events = []
    with lc_engine.instruments.subscribe(events.append):
        result = llm.generate(prompts)
    assert any(isinstance(e, ForwardEvent) and e.sequences > 1 for e in events)        # one batch
    assert [g[0].text for g in result.generations] == [g.text for g in alone]
    info = result.generations[0][0].generation_info
    assert "".join(e["token"] for e in info["logprobs"]["content"]) == result.generations[0][0].text
    usage = result.llm_output["token_usage"]
    assert usage["completion_tokens"] == sum(g.generation_info["usage_metadata"]["output_tokens"] for g in alone)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > 0


# ---- honoured or refused where given -------------------------------------------------------------
@pytest.mark.parametrize("bad, name", [({"repetition_penalty": 0}, "repetition_penalty"),
                                       ({"presence_penalty": 3}, "presence_penalty"),
                                       ({"top_logprobs": 3}, "top_logprobs"), ({"min_tokens": -1}, "min_new_tokens"),
                                       ({"logit_bias": {"x": 1}}, "logit_bias"), ({"temperature": -1}, "temperature")])
@pytest.mark.parametrize("cls", [ChatKVBoost, KVBoostLLM])
def test_a_bad_value_is_refused_by_the_constructor_naming_it(cls, bad, name):
    with pytest.raises(ValidationError, match=name):
        cls(**bad)


def test_bind_and_bind_tools_check_their_arguments_at_bind_time(lc_engine):
    chat = ChatKVBoost(engine=lc_engine)
    with pytest.raises(ValueError, match="best_of"):
        chat.bind(best_of=2)
    with pytest.raises(ValueError, match="frequency_penalty"):
        chat.bind_tools([get_weather], frequency_penalty=5)
    with pytest.raises(ValueError, match="parallel_tool_calls"):
        chat.bind_tools([get_weather], parallel_tool_calls="no")
    with pytest.raises(ValueError, match="unsupported call parameters"):
        KVBoostLLM(engine=lc_engine).bind(tools=[])


def test_parallel_tool_calls_false_keeps_the_first_call(lc_engine):
    chat = ChatKVBoost(engine=lc_engine, max_tokens=48)
    two = [{"name": "get_weather", "args": '{"city": "Paris"}', "id": "a", "index": 0, "type": "tool_call_chunk"},
           {"name": "get_weather", "args": '{"city": "Rome"}', "id": "b", "index": 1, "type": "tool_call_chunk"}]

    class Server(Generation):
        tool_calls = [{"name": c["name"], "arguments": c["args"], "id": c["id"], "index": c["index"]} for c in two]
    final = _Reply("m", one_call=True).chunk(Server(finish_reason="tool_calls"))
    assert [c["id"] for c in final.message.tool_call_chunks] == ["a"]
    bound = chat.bind_tools([get_weather], tool_choice="get_weather", parallel_tool_calls=False)
    reply = bound.invoke([HumanMessage("Weather in Paris?")])
    assert len(reply.tool_calls) == 1 and reply.tool_calls[0]["name"] == "get_weather"
