"""Sampling: greedy, top-k, top-p, seeds, min_new_tokens; and validation of every parameter."""
import math

import pytest
import torch

from kvboost_engine import InputError
from kvboost_engine.request.sampling import Sampler, SamplingParams

LOGITS = torch.tensor([0.0, 3.0, 2.9, 1.0, -1.0, 2.0])


def draws(params: SamplingParams, n: int = 400, logits=LOGITS) -> set[int]:
    sampler = Sampler(params, torch.device("cpu"))
    return {sampler(logits) for _ in range(n)}


def test_greedy_is_argmax():
    assert draws(SamplingParams.build(temperature=0), 5) == {1}


def test_top_k_keeps_only_the_k_best():
    assert draws(SamplingParams.build(temperature=5.0, top_k=2, seed=0)) == {1, 2}


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.softmax(LOGITS, -1)          # 1: .37, 2: .34, 5: .14, 3: .05, 0: .02, 4: .01
    assert probs[1] < 0.5 < probs[1] + probs[2]
    assert draws(SamplingParams.build(temperature=1.0, top_p=0.5, seed=0)) == {1, 2}
    assert draws(SamplingParams.build(temperature=1.0, top_p=0.3, seed=0)) == {1}


def test_a_seed_repeats_the_same_draws():
    def run(seed):
        sampler = Sampler(SamplingParams.build(temperature=1.0, seed=seed), torch.device("cpu"))
        return [sampler(LOGITS) for _ in range(50)]
    assert run(7) == run(7) and run(7) != run(8)


def test_min_new_tokens_keeps_eos_out_of_reach_until_reached():
    sampler = Sampler(SamplingParams.build(min_new_tokens=2), torch.device("cpu"), eos_ids={1})
    assert sampler(LOGITS, generated=0) == 2 and sampler(LOGITS, generated=1) == 2
    assert sampler(LOGITS, generated=2) == 1
    assert SamplingParams.build(max_new_tokens=3, min_new_tokens=10).min_new_tokens == 3


@pytest.mark.parametrize("bad", [
    dict(temperature=math.nan), dict(temperature=math.inf), dict(temperature=-1), dict(temperature="0.5"),
    dict(temperature=True), dict(top_p=0), dict(top_p=1.5), dict(top_p=math.nan), dict(top_k=-1),
    dict(top_k=1.5), dict(max_new_tokens=0), dict(max_new_tokens=2.0), dict(min_new_tokens=-1),
    dict(seed=2**70), dict(seed=-1), dict(seed="1"), dict(stop=5), dict(stop=[5]), dict(stop={"a": 1}),
])
def test_bad_parameters_are_input_errors(bad):
    with pytest.raises(InputError):
        SamplingParams.build(**bad)


@pytest.mark.parametrize("min_new", [0, 5])
def test_the_copy_free_greedy_path_picks_what_adjust_and_pick_pick(min_new):
    """Sampler.greedy (no copy of the logits) against adjust + pick, with an end token that is the
    maximum, ties with it before and after, and past min_new_tokens."""
    params = SamplingParams.build(max_new_tokens=8, min_new_tokens=min_new)
    sampler = Sampler(params, torch.device("cpu"), eos_ids={2, 7})
    cases = [torch.tensor([0.0, 1.0, 5.0, 3.0, 0.0, 0.0, 0.0, 4.0]),     # an end token is the maximum
             torch.tensor([0.0, 1.0, 5.0, 5.0, 0.0, 0.0, 0.0, 4.0]),     # an end token ties before another
             torch.tensor([0.0, 5.0, 5.0, 3.0, 0.0, 0.0, 0.0, 5.0]),     # a plain token ties before end tokens
             torch.tensor([0.0, 1.0, 2.0, 3.0, 9.0, 0.0, 0.0, 4.0])]
    for logits in cases:
        for generated in (0, 6):
            expected = sampler.pick(sampler.adjust(logits, generated))
            fast = sampler.greedy(logits, generated)
            assert fast is None or fast == expected
            if generated >= min_new or int(torch.argmax(logits)) not in (2, 7):
                assert fast == expected                         # the copy-free path served it
    hot = Sampler(SamplingParams.build(temperature=0.7), torch.device("cpu"))
    assert hot.greedy(cases[0]) is None                          # sampling: never this path


def test_argmax_is_torch_argmax_on_ties_nans_infinities_and_views():
    from kvboost_engine.request.sampling import argmax
    wide = torch.randn(3, 4096)
    cases = [torch.tensor([1.0, 3.0, 3.0, 2.0]), torch.tensor([1.0, float("nan"), 5.0, float("nan")]),
             torch.full((5,), float("-inf")), torch.tensor([float("inf"), 1.0, float("inf")]),
             wide[1], wide[:, 7], torch.randn(16, dtype=torch.bfloat16)]
    for logits in cases:
        assert argmax(logits) == int(torch.argmax(logits))
