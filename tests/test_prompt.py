"""Messages -> segments through the chat template; bad input errors."""
import pytest

from kvboost_engine.errors import InputError
from kvboost_engine.request.prompt import ChatRenderer, Segment, segments_from_prompt


@pytest.fixture(scope="module")
def renderer(smol):
    return ChatRenderer(smol[1])


def test_glue_system_and_messages_are_separate_segments(renderer, smol):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    segments = renderer.render(messages)
    kinds = [s.kind for s in segments]
    assert kinds == ["glue", "system", "glue", "user", "glue"]
    assert [s.text for s in segments if s.kind != "glue"] == ["Be brief.", "Hi there"]
    rendered = smol[1].apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "".join(s.text for s in segments) == rendered


def test_content_parts_become_segments(renderer):
    messages = [{"role": "user", "content": [
        {"type": "document", "text": "Doc one."}, {"type": "document", "text": "Doc two."},
        {"type": "text", "text": "Question?"}]}]
    segments = renderer.render(messages)
    docs = [s for s in segments if s.kind == "document"]
    assert [d.text for d in docs] == ["Doc one.", "Doc two."]
    assert [s.text for s in segments if s.kind == "user"] == ["Question?"]


def test_template_that_rewrites_content_falls_back_to_one_segment(smol):
    class Trimming:
        chat_template = "x"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return "".join(f"<{m['role']}>{m['content'].strip()}" for m in messages)

    segments = ChatRenderer(Trimming()).render([{"role": "user", "content": "  padded  "}])
    assert segments == [Segment("<user>padded", "text")]


@pytest.mark.parametrize("messages, message", [
    ([], "messages is empty"),
    ("hello", "list of"),
    ([{"role": "wizard", "content": "x"}], "unknown role 'wizard'"),
    ([{"role": "user", "content": 42}], "content must be a string or a list of parts"),
    ([{"role": "user", "content": [{"type": "image", "url": "x"}]}], "content part must be"),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "part text must be a string"),
    ([{"role": "user", "content": ""}], "all messages are empty"),
    (["not a dict"], "each message must be a dict"),
])
def test_bad_messages(renderer, messages, message):
    with pytest.raises(InputError, match=message):
        renderer.render(messages)


def test_plain_prompts():
    assert segments_from_prompt("abc") == [Segment("abc")]
    segs = segments_from_prompt(["a", {"text": "doc", "kind": "document"}, Segment("q", "user")])
    assert segs[1] == Segment("doc", "document") and segs[2].kind == "user"
    for bad in ("", [], [""], 5, [7]):
        with pytest.raises(InputError):
            segments_from_prompt(bad)


def test_a_lone_surrogate_outside_content_is_refused_after_rendering():
    class WithNames:
        chat_template = "x"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return "".join(f"<{m['role']} {m.get('name', '')}>{m['content']}" for m in messages)

    with pytest.raises(InputError, match="the rendered chat .* is not valid Unicode: lone surrogate"):
        ChatRenderer(WithNames()).render([{"role": "user", "content": "hi", "name": "\ud800"}])
