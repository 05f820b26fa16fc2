"""The KVBoost LlamaIndex LLM on the real default model: calls, telemetry, callbacks, async."""
from __future__ import annotations

import asyncio

import pytest
from holds import Hold, hold_engine_streams

pytest.importorskip("llama_index.core")

import llama_index.core  # noqa: E402
from llama_index.core import Settings  # noqa: E402
from llama_index.core.base.llms.types import ChatMessage, ImageBlock, MessageRole, TextBlock  # noqa: E402
from llama_index.core.callbacks import CallbackManager, TokenCountingHandler  # noqa: E402
from llama_index.core.indices.prompt_helper import PromptHelper  # noqa: E402

from kvboost_engine import Engine, InputError  # noqa: E402
from kvboost_engine import registry as shared_module  # noqa: E402
from kvboost_integrations.llama_index import DOCUMENT_BLOCKS, KVBoost, document_message, to_engine_messages  # noqa: E402
from kvboost_integrations.llama_index import prompt_helper  # noqa: E402

HELLO = [ChatMessage(role=MessageRole.SYSTEM, content="You are terse."),
         ChatMessage(role=MessageRole.USER, content="Name a colour.")]


@pytest.fixture
def llm(engine):
    return KVBoost(engine=engine, max_new_tokens=4)


def test_metadata_reports_the_model(llm, engine):
    meta = llm.metadata
    assert meta.context_window == engine.context_window == 8192
    assert meta.num_output == 4 and meta.is_chat_model and meta.is_function_calling_model
    assert meta.model_name == engine.model_name
    assert KVBoost(engine=engine, context_window=2048).metadata.context_window == 2048
    assert KVBoost(engine=engine, additional_kwargs={"max_tokens": 1024}).metadata.num_output == 1024
    for option in (dict(dtype="bfloat16"), dict(moved_reuse="blend"), dict(engine_kwargs={"weights": "int4"})):
        with pytest.raises(InputError, match="with engine="):
            KVBoost(engine=engine, **option)


def test_chat_matches_the_engine_and_reports_usage_and_reuse(llm, engine):
    expected = engine.chat(to_engine_messages(HELLO), max_new_tokens=4)   # also warms the cache
    response = llm.chat(HELLO)
    assert response.message.content == expected.text and response.message.role == MessageRole.ASSISTANT
    usage = response.raw["usage"]
    assert usage["prompt_tokens"] == usage["input_tokens"] == expected.prompt_tokens
    assert usage["completion_tokens"] == expected.completion_tokens
    telemetry = response.raw["kvboost"]
    assert telemetry["reused_exact"] == expected.prompt_tokens - 1      # all but the last prompt token
    assert telemetry["ttft_s"] > 0 and telemetry["finish_reason"] in ("stop", "length")
    assert response.additional_kwargs["reused_tokens"] == telemetry["reused_tokens"]


def test_stream_chat_deltas_add_up_and_last_chunk_carries_usage(llm):
    chunks = list(llm.stream_chat(HELLO))
    text = "".join(c.delta for c in chunks)
    assert text and chunks[-1].message.content == text
    assert all(c.raw is None for c in chunks[:-1])
    assert chunks[-1].raw["usage"]["completion_tokens"] >= 1


def test_complete_uses_the_chat_template_unless_formatted(llm, engine):
    via_chat = llm.complete("Name a colour.")
    assert via_chat.text == engine.chat([{"role": "user", "content": "Name a colour."}], max_new_tokens=4).text
    plain = llm.complete("The sky is", formatted=True)
    assert plain.text == engine.generate("The sky is", max_new_tokens=4).text
    assert plain.raw["usage"]["prompt_tokens"] == engine.count_tokens("The sky is")
    streamed = list(llm.stream_complete("The sky is", formatted=True))
    assert "".join(c.delta for c in streamed) == plain.text == streamed[-1].text


def test_system_prompt_and_custom_completion_to_prompt(engine):
    with_system = KVBoost(engine=engine, max_new_tokens=2, system_prompt="Answer in French.")
    out = with_system.complete("Hi")
    assert out.raw["usage"]["prompt_tokens"] == engine.count_tokens(
        [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi"}])
    custom = KVBoost(engine=engine, max_new_tokens=2, completion_to_prompt=lambda p: f"Q: {p}\nA:")
    assert custom.complete("Hi").raw["usage"]["prompt_tokens"] == engine.count_tokens("Q: Hi\nA:")


def test_stop_strings_and_per_call_overrides(llm, engine):
    free = llm.chat(HELLO, max_tokens=8).message.content
    assert len(free) > 3
    stop = free[2:4]
    stopped = llm.chat(HELLO, max_tokens=8, stop=[stop])
    assert stopped.message.content == free[:free.index(stop)]
    assert stopped.raw["kvboost"]["finish_reason"] == "stop"
    with pytest.raises(InputError, match="unknown arguments"):
        llm.chat(HELLO, best_of=2)


def test_messages_keep_parts_and_documents():
    message = document_message(MessageRole.USER, [("Context:", False), ("Node one.", True), ("Q?", False)])
    assert message.additional_kwargs[DOCUMENT_BLOCKS] == [1]
    converted = to_engine_messages([ChatMessage(role=MessageRole.DEVELOPER, content="sys"), message,
                                    ChatMessage(role=MessageRole.CHATBOT, content="ok")])
    assert converted[0] == {"role": "system", "content": "sys"}
    assert converted[1]["content"] == [{"type": "text", "text": "Context:"},
                                       {"type": "document", "text": "Node one."},
                                       {"type": "text", "text": "Q?"}]
    assert converted[2] == {"role": "assistant", "content": "ok"}
    image = ChatMessage(role=MessageRole.USER, blocks=[TextBlock(text="see"), ImageBlock(url="http://x/y.png")])
    with pytest.raises(InputError, match="text only"):
        to_engine_messages([image])


@pytest.mark.parametrize("call, match", [
    (lambda llm: llm.complete(5), r"complete\(\) takes the prompt as a string, got int \(5\)"),
    (lambda llm: llm.complete(None), r"complete\(\) takes the prompt as a string, got NoneType"),
    (lambda llm: llm.stream_complete(b"hi"), r"complete\(\) takes the prompt as a string, got bytes"),
    (lambda llm: llm.chat([HELLO[0], ChatMessage(role=MessageRole.USER, content=5)]),
     r"message 1 \(role 'user'\) has no content: ChatMessage\(content=...\) takes a string or a list of blocks"),
    (lambda llm: llm.chat([ChatMessage(role=MessageRole.USER, content=None)]), r"message 0 \(role 'user'\) has no content"),
    (lambda llm: llm.chat(m for m in HELLO), "messages must be a list of ChatMessage, got generator .*pass a list"),
    (lambda llm: llm.stream_chat(iter(HELLO)), "messages must be a list of ChatMessage, got list_iterator"),
    (lambda llm: llm.chat([{"role": "user", "content": "hi"}]), "message 0 must be a ChatMessage, got dict"),
])
def test_wrong_arguments_say_what_was_wrong(llm, engine, call, match):
    with pytest.raises(InputError, match=match):
        call(llm)
    expected = engine.chat(to_engine_messages(HELLO), max_new_tokens=4)
    assert llm.chat(HELLO).message.content == expected.text          # still answers


def test_token_counting_handler_reads_our_usage(llm, engine):
    counter = TokenCountingHandler(tokenizer=llm.tokenizer)
    llm.callback_manager = CallbackManager([counter])
    response = llm.chat(HELLO)
    for _ in llm.stream_complete("The sky is", formatted=True):
        pass
    events = counter.llm_token_counts
    assert len(events) == 2
    assert events[0].prompt_token_count == response.raw["usage"]["prompt_tokens"]
    assert events[1].prompt_token_count == engine.count_tokens("The sky is")


def test_tokenizer_hook_counts_with_the_model_tokenizer(llm, engine):
    text = "Tokenizers differ: naïve café, 12345 and emojis 🙂."
    expected = len(engine.tokenizer(text, add_special_tokens=False)["input_ids"])
    assert len(llm.tokenizer(text)) == expected
    assert prompt_helper(llm)._token_counter.get_string_tokens(text) == expected
    previous = llama_index.core.global_tokenizer
    try:
        Settings.tokenizer = llm.tokenizer
        assert PromptHelper.from_llm_metadata(llm.metadata)._token_counter.get_string_tokens(text) == expected
    finally:
        llama_index.core.global_tokenizer = previous


def test_async_variants_match_sync(llm):
    sync_text = llm.chat(HELLO).message.content

    async def run():
        chat = await llm.achat(HELLO)
        stream = [c async for c in await llm.astream_chat(HELLO)]
        done = await llm.acomplete("The sky is", formatted=True)
        pieces = [c.delta async for c in await llm.astream_complete("The sky is", formatted=True)]
        return chat, stream, done, pieces

    chat, stream, done, pieces = asyncio.run(run())
    assert chat.message.content == sync_text == "".join(c.delta for c in stream)
    assert stream[-1].raw["usage"]["completion_tokens"] >= 1
    assert "".join(pieces) == done.text


def test_async_generation_does_not_block_the_event_loop(engine, monkeypatch):
    hold = Hold(at=2, timeout=30)                  # the request stays in flight until the loop has ticked
    hold_engine_streams(monkeypatch, hold)
    llm = KVBoost(engine=engine, max_new_tokens=12)
    ticks_while_held = 0

    async def ticker(stop: asyncio.Event):
        nonlocal ticks_while_held
        while not stop.is_set():
            await asyncio.sleep(0.01)
            if hold.reached.is_set() and not hold.release.is_set():
                ticks_while_held += 1
                if ticks_while_held == 10:
                    hold.release.set()

    async def run():
        stop = asyncio.Event()
        tick = asyncio.create_task(ticker(stop))
        try:                                       # if achat blocked the loop, the hold would time out
            return await llm.achat([ChatMessage(role=MessageRole.USER, content="Count from one to ten.")])
        finally:
            hold.release.set()
            stop.set()
            await tick

    response = asyncio.run(run())
    assert response.raw["usage"]["completion_tokens"] >= 2
    assert ticks_while_held == 10                  # ticked while the request waited mid-generation


def test_cancelling_an_async_stream_stops_decoding(engine):
    llm = KVBoost(engine=engine, max_new_tokens=200)

    async def run():
        first = asyncio.Event()

        async def consume():
            async for _ in await llm.astream_chat([ChatMessage(role=MessageRole.USER, content="Write a long story.")]):
                first.set()

        task = asyncio.create_task(consume())
        await first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(300):                              # the worker finishes its request
            if engine.stats()["requests"] == 1:
                break
            await asyncio.sleep(0.02)

    asyncio.run(run())
    stats = engine.stats()
    assert stats["requests"] == 1
    assert stats["generated_tokens"] < 50


def test_same_settings_share_one_engine(monkeypatch, smol):
    built = []

    def fake_from_pretrained(model=None, **options):
        built.append(options)
        return Engine(*smol, cache_bytes=0)

    monkeypatch.setattr(shared_module.Engine, "from_pretrained", staticmethod(fake_from_pretrained))
    registry = shared_module.EngineRegistry()
    monkeypatch.setattr(shared_module, "_REGISTRY", registry)
    a, b = KVBoost(cache_bytes=2**20), KVBoost(cache_bytes=2**20, temperature=0.5)
    c = KVBoost(cache_bytes=2**21)
    assert a.engine is b.engine and a.engine is not c.engine
    assert built == [{"cache_bytes": 2**20}, {"cache_bytes": 2**21}]
    assert KVBoost(cache_bytes=2**20).to_payload()["class_name"] == "KVBoost"    # payload never loads
    assert len(built) == 2


def test_the_hf_wrappers_argument_names_are_refused_with_a_hint():
    """`model_name` is what HuggingFaceLLM takes: an error naming `model`, not a silently loaded default."""
    with pytest.raises(ValueError, match=r"unexpected argument 'model_name'; did you mean 'model'\?.*Accepted:.*engine_kwargs"):
        KVBoost(model_name="x")
