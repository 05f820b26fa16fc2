"""LlamaIndex KVBoost: the sampling controls (fields, additional_kwargs, per call), logprobs in
ChatResponse/CompletionResponse.logprobs (streamed too), timeout, context_window and num_output."""
from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("llama_index.core")

import torch  # noqa: E402
from llama_index.core.base.llms.types import ChatMessage, MessageRole  # noqa: E402

from kvboost_engine import Engine, InputError  # noqa: E402
from kvboost_integrations.llama_index import KVBoost, to_engine_messages  # noqa: E402

NUMBERS = [ChatMessage(role=MessageRole.USER, content="List the numbers.")]     # greedy SmolLM2 counts on
HELLO = [ChatMessage(role=MessageRole.USER, content="Say hello.")]


@pytest.fixture(scope="module")
def li_engine(smol):
    model, tokenizer = smol
    return Engine(model, tokenizer, cache_bytes=64 * 2**20)


@pytest.mark.parametrize("control", [{"repetition_penalty": 1.5}, {"frequency_penalty": 1.0},
                                     {"presence_penalty": 1.5}, {"min_new_tokens": 30}])
def test_each_control_reaches_the_engine_from_field_additional_kwargs_or_call(li_engine, control):
    expected = li_engine.chat(to_engine_messages(NUMBERS), max_new_tokens=30, **control).text
    field = KVBoost(engine=li_engine, max_new_tokens=30, **control).chat(NUMBERS)
    extra = KVBoost(engine=li_engine, max_new_tokens=30, additional_kwargs=control).chat(NUMBERS)
    call = KVBoost(engine=li_engine, max_new_tokens=30).chat(NUMBERS, **control)
    assert field.message.content == extra.message.content == call.message.content == expected


def test_a_repetition_penalty_changes_the_looping_reply(li_engine):
    plain = KVBoost(engine=li_engine, max_new_tokens=30).chat(NUMBERS).message.content
    assert plain.startswith("The numbers are: 1, 2, 3, 4, 5")
    assert KVBoost(engine=li_engine, max_new_tokens=30, repetition_penalty=1.5).chat(NUMBERS).message.content != plain


def test_logit_bias_and_min_tokens_by_their_openai_names(li_engine):
    banana = li_engine.tokenizer(" banana", add_special_tokens=False)["input_ids"][0]
    llm = KVBoost(engine=li_engine, max_new_tokens=3, additional_kwargs={"logit_bias": {banana: 100}})
    assert llm.complete("Say hello.").text.lstrip().startswith("banana")
    reply = KVBoost(engine=li_engine, max_new_tokens=40).chat(HELLO, min_tokens=35)
    assert reply.raw["usage"]["completion_tokens"] >= 35


def test_chat_logprobs_are_the_engines_log_softmax_chosen_token_first(li_engine):
    llm = KVBoost(engine=li_engine, max_new_tokens=10, logprobs=True, top_logprobs=3)
    response = llm.chat(HELLO)
    assert len(response.logprobs) == 10
    expected = torch.log_softmax(li_engine.next_token_logits(messages=to_engine_messages(HELLO)), -1)
    chosen, *others = response.logprobs[0]
    best = torch.topk(expected, 3)
    assert chosen.logprob == pytest.approx(float(best.values[0]), abs=1e-5)        # greedy: the best token
    assert [o.logprob for o in others] == pytest.approx(best.values[1:].tolist(), abs=1e-5)
    assert "".join(token[0].token for token in response.logprobs) == response.message.content
    streamed = list(llm.stream_chat(HELLO))
    assert len(streamed[1].logprobs) > len(streamed[0].logprobs) > 0              # cumulative, as the text
    assert streamed[-1].logprobs == response.logprobs
    assert llm.complete("Say hello.").logprobs
    assert KVBoost(engine=li_engine, max_new_tokens=3).chat(HELLO).logprobs is None


def test_bad_values_and_names_are_refused_at_construction():
    with pytest.raises(ValueError, match="repetition_penalty"):
        KVBoost(repetition_penalty=0)
    with pytest.raises(InputError, match="best_of"):
        KVBoost(additional_kwargs={"best_of": 2})
    with pytest.raises(InputError, match="frequency_penalty"):
        KVBoost(additional_kwargs={"frequency_penalty": 9})
    with pytest.raises(InputError, match="top_logprobs needs logprobs"):
        KVBoost(top_logprobs=2)


def test_timeout_cancels_a_request_sync_and_async(li_engine):
    llm = KVBoost(engine=li_engine, max_new_tokens=200, min_new_tokens=200, timeout=0.3)
    with pytest.raises(TimeoutError):
        llm.chat(HELLO)
    with pytest.raises(TimeoutError):
        asyncio.run(llm.achat(HELLO))
    assert KVBoost(engine=li_engine, max_new_tokens=2, timeout=60).chat(HELLO).message.content
    per_call = KVBoost(engine=li_engine, max_new_tokens=200, min_new_tokens=200)   # README: per call too
    with pytest.raises(TimeoutError):
        per_call.complete("Hi", timeout=0.3)
    with pytest.raises(TimeoutError):
        asyncio.run(per_call.achat(HELLO, timeout=0.3))
    assert KVBoost(engine=li_engine, max_new_tokens=2, timeout=0.01).chat(HELLO, timeout=60).message.content
    with pytest.raises(InputError, match="timeout must be"):
        per_call.chat(HELLO, timeout=-1)
    with pytest.raises(InputError, match="embedded engine"):
        KVBoost(endpoint="http://127.0.0.1:9/v1").complete("Hi", timeout=5)


def test_context_window_and_num_output_come_from_the_model_unless_given(li_engine):
    meta = KVBoost(engine=li_engine, max_new_tokens=64).metadata
    assert (meta.context_window, meta.num_output) == (li_engine.context_window, 64)
    meta = KVBoost(engine=li_engine, max_new_tokens=64, context_window=4096, num_output=300).metadata
    assert (meta.context_window, meta.num_output) == (4096, 300)
    with pytest.raises(InputError, match="beyond the model's context window"):
        KVBoost(engine=li_engine, context_window=li_engine.context_window + 1).metadata
