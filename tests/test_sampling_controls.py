"""Logits processors and logprobs in the engine: each control's arithmetic on known logits, its
effect on a real reply, logprobs equal to the engine's log-softmax, and per-request settings in a batch."""
import math
import threading

import pytest
import torch

from kvboost_engine import Engine, InputError, TextDelta
from kvboost_engine.request.sampling import Sampler, SamplingParams

LOGITS = torch.tensor([0.0, 3.0, 2.9, 1.0, -1.0, 2.0])
CPU = torch.device("cpu")
NUMBERS = [{"role": "user", "content": "List the numbers."}]       # SmolLM2 counts on and on, greedily
HELLO = [{"role": "user", "content": "Say hello."}]


# ---- the arithmetic, on known logits ---------------------------------------------------------
def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    s = Sampler(SamplingParams.build(repetition_penalty=2.0), CPU, prompt_ids=[1, 4])
    adjusted = s.adjust(LOGITS)
    assert torch.allclose(adjusted, torch.tensor([0.0, 1.5, 2.9, 1.0, -2.0, 2.0]))   # seen: 1 (3 / 2), 4 (-1 * 2)
    assert s.pick(adjusted) == 2
    s.accept(2)                                                      # the reply counts too
    assert s.adjust(LOGITS)[2] == pytest.approx(1.45)


def test_presence_and_frequency_penalties_count_the_reply_only():
    s = Sampler(SamplingParams.build(presence_penalty=0.5, frequency_penalty=0.25), CPU, prompt_ids=[1, 1, 1])
    assert torch.equal(s.adjust(LOGITS), LOGITS)                     # the prompt does not count
    s.accept(1)
    s.accept(1)
    s.accept(5)
    expected = LOGITS.clone()
    expected[1] -= 0.5 + 2 * 0.25
    expected[5] -= 0.5 + 0.25
    assert torch.allclose(s.adjust(LOGITS), expected)


def test_logit_bias_is_added_and_accepts_openai_string_keys():
    s = Sampler(SamplingParams.build(logit_bias={"4": 10, 1: -100}), CPU)
    adjusted = s.adjust(LOGITS)
    assert adjusted[4] == 9.0 and adjusted[1] == -97.0 and s.pick(adjusted) == 4
    assert SamplingParams.build(logit_bias={"4": 1, 4: 2}).logit_bias == ((4, 2.0),)


def test_the_default_sampler_leaves_the_logits_as_they_are():
    s = Sampler(SamplingParams.build(), CPU, prompt_ids=[1, 2])
    assert s.penalties is None and s.adjust(LOGITS) is LOGITS


@pytest.mark.parametrize("bad", [
    dict(repetition_penalty=0), dict(repetition_penalty=-1.0), dict(repetition_penalty=math.inf),
    dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(frequency_penalty="1"),
    dict(logit_bias=[1, 2]), dict(logit_bias={"a": 1}), dict(logit_bias={-1: 1}), dict(logit_bias={1: 101}),
    dict(logit_bias={1: math.nan}), dict(logprobs=1), dict(top_logprobs=21), dict(top_logprobs=3),
    dict(logprobs=True, top_logprobs=-1),
])
def test_bad_processor_parameters_are_input_errors_naming_them(bad):
    with pytest.raises(InputError, match=next(iter(bad)) if "top_logprobs" not in bad else "top_logprobs"):
        SamplingParams.build(**bad)


# ---- on the real model -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def eng(smol):
    model, tokenizer = smol
    return Engine(model, tokenizer, cache_bytes=64 * 2**20)


def test_repetition_penalty_breaks_a_looping_greedy_reply(eng):
    plain = eng.chat(NUMBERS, max_new_tokens=40)
    assert plain.text.startswith("The numbers are: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10")          # the loop
    penalized = eng.chat(NUMBERS, max_new_tokens=40, repetition_penalty=1.5)
    assert len(set(penalized.token_ids)) > len(set(plain.token_ids)) + 10
    logits = eng.next_token_logits(messages=NUMBERS)
    first = Sampler(SamplingParams.build(repetition_penalty=1.5), CPU,
                    prompt_ids=eng.encode_messages(NUMBERS).token_ids).adjust(logits)
    assert penalized.token_ids[0] == int(torch.argmax(first))           # over the prompt's tokens too


def test_frequency_and_presence_penalties_change_a_repetitive_reply(eng):
    plain = eng.chat(NUMBERS, max_new_tokens=40)
    frequency = eng.chat(NUMBERS, max_new_tokens=40, frequency_penalty=1.0)
    commas = eng.tokenizer(",", add_special_tokens=False)["input_ids"][0]
    assert frequency.token_ids.count(commas) < plain.token_ids.count(commas)
    ask = [{"role": "user", "content": "Write the word 'yes' many times."}]
    assert eng.chat(ask, max_new_tokens=40, presence_penalty=1.5).text != eng.chat(ask, max_new_tokens=40).text


def test_logit_bias_bans_or_forces_a_token(eng):
    logits = eng.next_token_logits(messages=HELLO)
    best = int(torch.argmax(logits))
    banned = eng.chat(HELLO, max_new_tokens=3, logit_bias={best: -100})
    assert banned.token_ids[0] == int(torch.topk(logits, 2).indices[1])
    forced = eng.tokenizer(" banana", add_special_tokens=False)["input_ids"][0]
    assert eng.chat(HELLO, max_new_tokens=3, logit_bias={forced: 100}).token_ids[0] == forced
    with pytest.raises(InputError, match="beyond this model's"):
        eng.chat(HELLO, max_new_tokens=3, logit_bias={10**7: 1})


def test_a_turn_end_token_ends_the_reply_as_llama_cpp_ends_it(eng):
    """A GGUF stores one eos id (SmolLM2's <|im_end|>, Gemma 3's <eos>): its other end-of-generation
    tokens (<|endoftext|>, Gemma's <end_of_turn>, as llama.cpp lists them) were written as text and
    dropped, the model writing on to max_new_tokens."""
    from kvboost_engine.wiring import eos_ids
    end = eng.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert {end, eng.tokenizer.convert_tokens_to_ids("<|im_end|>")} <= eos_ids(eng.model, eng.tokenizer)
    forced = eng.chat(HELLO, max_new_tokens=4, logit_bias={end: 100})
    assert (forced.token_ids, forced.finish_reason) == ([end], "stop")


def test_logprobs_are_the_engines_log_softmax_and_change_no_token(eng):
    plain = eng.chat(HELLO, max_new_tokens=12)
    assert plain.logprobs is None
    gen = eng.chat(HELLO, max_new_tokens=12, logprobs=True, top_logprobs=3)
    assert gen.token_ids == plain.token_ids
    expected = torch.log_softmax(eng.next_token_logits(messages=HELLO), -1)
    first = gen.logprobs[0]
    assert first["token_id"] == gen.token_ids[0]
    assert first["logprob"] == pytest.approx(float(expected[first["token_id"]]), abs=1e-5)
    tops = first["top_logprobs"]
    assert [t["token_id"] for t in tops] == torch.topk(expected, 3).indices.tolist()
    assert tops[0]["token_id"] == first["token_id"]                   # greedy: the best one
    assert len(gen.logprobs) == 12 and "".join(e["token"] for e in gen.logprobs) == gen.text
    assert all(bytes(e["bytes"]).decode() == e["token"] for e in gen.logprobs)


def test_streamed_deltas_carry_the_logprobs_of_their_tokens(eng):
    stream = eng.stream_chat(HELLO, max_new_tokens=12, logprobs=True)
    deltas = list(stream)
    assert all(isinstance(d, TextDelta) for d in deltas)
    carried = [entry for d in deltas for entry in d.logprobs]
    assert carried == stream.generation.logprobs[:len(carried)] and len(carried) >= len(deltas)
    assert all(entry["top_logprobs"] == [] for entry in carried)
    assert not any(isinstance(d, TextDelta) for d in eng.stream_chat(HELLO, max_new_tokens=4))


def test_batched_requests_keep_their_own_settings(eng):
    first = eng.chat(NUMBERS, max_new_tokens=1).token_ids[0]
    settings = [{}, {"repetition_penalty": 1.5}, {"logit_bias": {first: -100}}, {"logprobs": True}]
    alone = [eng.chat(NUMBERS, max_new_tokens=16, **kw) for kw in settings]
    together = [None] * len(settings)

    def work(i):
        together[i] = eng.chat(NUMBERS, max_new_tokens=16, **settings[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(settings))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [g.token_ids for g in together] == [g.token_ids for g in alone]
    assert len({tuple(g.token_ids) for g in alone}) == 3                  # logprobs change nothing
    assert together[3].logprobs is not None and together[0].logprobs is None
