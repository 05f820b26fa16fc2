"""Incremental text with stop strings: never split characters, never return stop text."""
import pytest

from kvboost_engine.request.detok import TextAssembler


def feed(tokenizer, text, stops=()):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assembler = TextAssembler(tokenizer, tuple(stops))
    deltas = []
    for token in ids:
        deltas.append(assembler.add(token))
        if assembler.stopped_at is not None:
            break
    else:
        deltas.append(assembler.finish())
    return assembler, deltas


def test_multibyte_characters_are_never_split(smol):
    text = "Grüße aus Köln 🙂 — ça va? 日本語のテキスト ✓"
    assembler, deltas = feed(smol[1], text)
    assert "".join(deltas) == text == assembler.final_text
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("stop", ["\nObservation:", "END", "Köln 🙂"])
def test_multi_token_stop_string_is_cut_and_not_returned(smol, stop):
    text = "The answer is 42.\nObservation: END and Köln 🙂 later"
    assembler, deltas = feed(smol[1], text, [stop])
    expected = text[:text.index(stop)]
    assert assembler.final_text == expected
    assert "".join(deltas) == expected


def test_partial_stop_prefix_is_released_when_it_does_not_complete(smol):
    assembler, deltas = feed(smol[1], "a OBS b", ["OBSERVE"])
    assert "".join(deltas) == "a OBS b"
    assert assembler.stopped_at is None
