"""Reasoning models on a tiny random Qwen3 with the real Qwen3 chat template (qwen3_tiny.py): the
per-call thinking switch, thinking separated from the answer (LangChain reasoning_content,
LlamaIndex ThinkingBlock), earlier turns' thinking handled as the template does, cache reuse kept."""
import pytest

pytest.importorskip("langchain_core")
pytest.importorskip("llama_index.core")

from langchain_core.messages import AIMessage, HumanMessage  # noqa: E402
from llama_index.core.base.llms.types import ChatMessage, MessageRole, TextBlock, ThinkingBlock  # noqa: E402

from kvboost_engine import InputError  # noqa: E402
from kvboost_integrations._reasoning import ThinkingSplitter  # noqa: E402
from kvboost_integrations.langchain import ChatKVBoost  # noqa: E402
from kvboost_integrations.langchain.messages import to_engine_messages as lc_messages  # noqa: E402
from kvboost_integrations.llama_index import KVBoost, to_engine_messages  # noqa: E402
from qwen3_tiny import qwen3_engine  # noqa: E402
from tool_families import family_engine  # noqa: E402

ASK = "Capital of France?"
# the scripted tiny Qwen3: thinking on -> "<think>Let</think>Paris"; the template's empty think block -> "Rome"


@pytest.fixture(scope="module")
def qwen3():
    return qwen3_engine()


def _split(text: str, size: int) -> tuple[str, str]:
    splitter, thought, answer = ThinkingSplitter(), "", ""
    for at in range(0, len(text), size):
        t, a = splitter.feed(text[at:at + size])
        thought, answer = thought + t, answer + a
    t, a = splitter.finish()
    return thought + t, answer + a


@pytest.mark.parametrize("size", [1, 2, 3, 7, 100])
def test_the_splitter_separates_thinking_however_the_text_is_cut(size):
    assert _split("<think>\nFirst, Paris.\nYes.\n</think>\n\nIt is Paris.", size) == ("First, Paris.\nYes.",
                                                                                      "It is Paris.")
    assert _split("No thinking <think> here.", size) == ("", "No thinking <think> here.")
    assert _split("<think>\ncut short", size) == ("cut short", "")


def test_a_reply_that_starts_inside_an_open_think_block():
    splitter = ThinkingSplitter(inside=True)
    assert splitter.feed("plan\n</think>\n\nanswer") == ("plan", "answer")


# ---- LangChain -------------------------------------------------------------------------------------
def test_langchain_reasoning_true_puts_thinking_in_reasoning_content(qwen3):
    reply = ChatKVBoost(engine=qwen3, max_tokens=10, reasoning=True).invoke(ASK)
    assert reply.content == "Paris" and reply.additional_kwargs["reasoning_content"] == "Let"
    chunks = list(ChatKVBoost(engine=qwen3, max_tokens=10).stream(ASK, reasoning=True))     # per call, streamed
    assert "".join(c.additional_kwargs.get("reasoning_content", "") for c in chunks) == "Let"
    assert "".join(c.content for c in chunks) == "Paris"
    assert not any(c.content and c.additional_kwargs.get("reasoning_content") for c in chunks)


def test_langchain_reasoning_false_switches_thinking_off_and_none_keeps_the_text(qwen3):
    off = ChatKVBoost(engine=qwen3, max_tokens=10, reasoning=False).invoke(ASK)
    assert off.content == "Rome" and "reasoning_content" not in off.additional_kwargs
    assert ChatKVBoost(engine=qwen3, max_tokens=10).invoke(ASK).content == "<think>Let</think>Paris"
    chat = ChatKVBoost(engine=qwen3, max_tokens=10, reasoning=False)
    assert chat.get_num_tokens_from_messages([HumanMessage(ASK)]) == off.usage_metadata["input_tokens"]


def test_a_template_without_a_switch_refuses_reasoning_by_name():
    engine = family_engine("qwen2")                      # Qwen2.5's real template: no thinking switch
    for value in (True, False):
        with pytest.raises(InputError, match=f"reasoning={value}"):
            ChatKVBoost(engine=engine, max_tokens=2, reasoning=value).invoke(ASK)
    with pytest.raises(InputError, match="^thinking=False needs .*thinking switch"):     # LlamaIndex's name
        KVBoost(engine=engine, max_new_tokens=2, thinking=False).chat([ChatMessage(role="user", content=ASK)])


def test_earlier_thinking_goes_to_the_template_which_keeps_it_only_after_the_last_question(qwen3):
    thought = AIMessage("Paris", additional_kwargs={"reasoning_content": "Let"})
    assert lc_messages([thought], native_tools=True)[0]["reasoning_content"] == "Let"
    later = [HumanMessage(ASK), thought, HumanMessage("And Italy?")]
    text = qwen3.tokenizer.decode(qwen3.encode_messages(lc_messages(later, native_tools=True)).token_ids)
    assert "Let" not in text and "<|im_start|>assistant\nParis<|im_end|>" in text       # an earlier turn: dropped
    looping = [{"role": "user", "content": ASK}, {"role": "assistant", "content": "", "reasoning_content": "Let",
                                                  "tool_calls": [{"type": "function", "function": {
                                                      "name": "f", "arguments": {}}}]},
               {"role": "tool", "content": "42"}]
    text = qwen3.tokenizer.decode(qwen3.encode_messages(looping).token_ids)
    assert "<think>\nLet\n</think>" in text                                              # a tool loop: kept


def test_the_next_turn_reuses_the_cached_prompt_after_a_thinking_reply(qwen3):
    chat = ChatKVBoost(engine=qwen3, max_tokens=10, reasoning=True)
    first = chat.invoke([HumanMessage(ASK)])
    second = chat.invoke([HumanMessage(ASK), first, HumanMessage("And Italy?")])
    assert second.response_metadata["reused_exact"] >= first.usage_metadata["input_tokens"]
    assert second.content == "Paris" and second.additional_kwargs["reasoning_content"] == "Let"


# ---- LlamaIndex ------------------------------------------------------------------------------------
def test_llama_index_thinking_true_gives_a_thinking_block_before_the_answer(qwen3):
    llm = KVBoost(engine=qwen3, max_new_tokens=10, thinking=True)
    response = llm.chat([ChatMessage(role=MessageRole.USER, content=ASK)])
    blocks = response.message.blocks
    assert isinstance(blocks[0], ThinkingBlock) and blocks[0].content == "Let"
    assert isinstance(blocks[1], TextBlock) and blocks[1].text == "Paris"
    streamed = list(llm.stream_chat([ChatMessage(role=MessageRole.USER, content=ASK)]))
    assert "".join(r.additional_kwargs.get("thinking_delta", "") for r in streamed) == "Let"
    assert "".join(r.delta for r in streamed) == "Paris"
    assert llm.complete(ASK).additional_kwargs["thinking"] == "Let"


def test_llama_index_thinking_false_per_call_and_thinking_blocks_in_history(qwen3):
    llm = KVBoost(engine=qwen3, max_new_tokens=10)
    assert llm.chat([ChatMessage(role=MessageRole.USER, content=ASK)], thinking=False).message.content == "Rome"
    earlier = ChatMessage(role=MessageRole.ASSISTANT, blocks=[ThinkingBlock(content="Let"), TextBlock(text="Paris")])
    assert to_engine_messages([earlier])[0] == {"role": "assistant", "content": "Paris", "reasoning_content": "Let"}


def test_reasoning_is_checked_at_bind_time_and_honoured_when_bound(qwen3):
    with pytest.raises(ValueError, match="reasoning must be"):
        ChatKVBoost(engine=qwen3).bind(reasoning="yes")
    bound = ChatKVBoost(engine=qwen3, max_tokens=10).bind(reasoning=True)
    assert bound.invoke(ASK).additional_kwargs["reasoning_content"] == "Let"


def test_a_reply_a_grammar_writes_is_the_answer_after_a_think_block_the_prompt_opened(smol):
    """A template that opens <think> in the generation prompt (DeepSeek-R1's) with reasoning on:
    the JSON of with_structured_output / structured_predict and a forced call went to the thinking
    (an OutputParserException, no tool call)."""
    import copy
    from typing import Literal
    from pydantic import BaseModel
    from kvboost_engine import Engine
    from llama_index.core.prompts import PromptTemplate

    class City(BaseModel):
        city: Literal["Paris", "Rome"]

    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """Weather of a city."""
        return "sunny"

    model, tokenizer = smol
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                               "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
    with Engine(model, tokenizer) as engine:
        llm = ChatKVBoost(engine=engine, max_tokens=40, reasoning=True)
        assert llm.with_structured_output(City).invoke("Weather in Paris?").city in ("Paris", "Rome")
        assert llm.bind_tools([get_weather], tool_choice="any").invoke("Weather in Paris?").tool_calls[0]["args"]
        li = KVBoost(engine=engine, max_new_tokens=40, thinking=True)
        assert li.structured_predict(City, PromptTemplate("Weather in {c}?"), c="Paris").city in ("Paris", "Rome")
        with pytest.raises(InputError, match="cannot be turned off"):      # (it said the template has neither)
            ChatKVBoost(engine=engine, max_tokens=2, reasoning=False).invoke("Hi")


def test_token_counts_take_the_thinking_switch_and_template_kwargs(qwen3):
    """Qwen3's switch off writes an empty think block into the prompt: the LlamaIndex count and the
    count over an endpoint left it out (13 against the 17 tokens the call used)."""
    pytest.importorskip("starlette")
    from kvboost_engine.serve import Server, create_app
    question = [ChatMessage(role="user", content=ASK)]
    for options in ({"thinking": False}, {"template_kwargs": {"enable_thinking": False}}, {"thinking": True}):
        llm = KVBoost(engine=qwen3, max_new_tokens=2, **options)
        assert llm.count_prompt_tokens(question) == llm.chat(question).raw["usage"]["prompt_tokens"]
    with Server(create_app(qwen3)) as server:
        for reasoning in (False, True, None):
            llm = ChatKVBoost(endpoint=server.url, max_tokens=2, reasoning=reasoning)
            used = llm.invoke([HumanMessage(ASK)]).usage_metadata["input_tokens"]
            assert llm.get_num_tokens_from_messages([HumanMessage(ASK)]) == used
