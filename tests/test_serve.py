"""Our OpenAI-compatible server (kvboost_engine.serve) with unmodified clients: the openai package,
LangChain's ChatOpenAI and our ChatKVBoost(endpoint=...); replies token-exact with the engine's own;
cached tokens; the hygiene (401, 400, 413, 429, 503 while draining, a client that leaves)."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from kvboost_engine import Engine, InputError  # noqa: E402
from kvboost_engine.serve import Server, create_app  # noqa: E402

KEY = "test-key"
MODEL = "smol"
SYSTEM = "You are a helpful assistant. Answer in one short sentence. " * 4
QUESTION = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"]}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def served(smol):
    engine = Engine(*smol, cache_bytes=256 * 2**20)
    with Server(create_app(engine, model_name=MODEL, api_key=KEY)) as server:
        yield engine, server
    engine.close()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[1].url, api_key=KEY, max_retries=0)


def _post(server, path, body, key=KEY, **kwargs):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + path, headers=headers, timeout=60, **kwargs, **(
        {"json": body} if not isinstance(body, (bytes, str)) else {"content": body}))


def test_chat_greedy_equals_engine_and_reports_cached_tokens(served, client):
    engine, _ = served
    first = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=12)
    direct = engine.chat(QUESTION, max_new_tokens=12)
    assert first.choices[0].message.content == direct.text
    assert first.choices[0].finish_reason == ("length" if direct.finish_reason == "length" else "stop")
    again = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=12)
    assert again.choices[0].message.content == direct.text
    assert again.usage.prompt_tokens == direct.prompt_tokens
    assert again.usage.completion_tokens == direct.completion_tokens
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_chat_stream_with_usage(served, client):
    engine, _ = served
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=10,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes in (["length"], ["stop"])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    assert text == engine.chat(QUESTION, max_new_tokens=10).text


def test_completions_and_models(served, client):
    engine, _ = served
    reply = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=6)
    assert reply.choices[0].text == engine.generate("The capital of France is", max_new_tokens=6).text
    streamed = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0,
                                         max_tokens=6, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == reply.choices[0].text
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL] and models[0].model_extra["max_model_len"] == engine.context_window


def test_documents_and_json_schema(served, client):
    engine, _ = served
    messages = [{"role": "user", "content": [{"type": "document", "text": "Paris is the capital of France."},
                                             {"type": "text", "text": "What is the capital of France?"}]}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=8)
    assert reply.choices[0].message.content == engine.chat(messages, max_new_tokens=8).text
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
    shaped = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=30,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    assert set(json.loads(shaped.choices[0].message.content)) == {"city"}


def test_langchain_chat_openai_and_chat_kvboost(served):
    from langchain_openai import ChatOpenAI

    from kvboost_integrations.langchain import ChatKVBoost
    engine, server = served
    expected = engine.chat(QUESTION, max_new_tokens=8).text
    theirs = ChatOpenAI(base_url=server.url, api_key=KEY, model=MODEL, temperature=0, max_tokens=8, max_retries=0)
    assert theirs.invoke(QUESTION).content == expected
    assert "".join(chunk.content for chunk in theirs.stream(QUESTION)) == expected
    ours = ChatKVBoost(endpoint=server.url, api_key=KEY, max_tokens=8, temperature=0.0)
    reply = ours.invoke(QUESTION)
    assert reply.content == expected
    assert reply.usage_metadata["input_token_details"]["cache_read"] > 0
    ours.get_engine().close()


def test_api_key_bad_json_unknown_field_and_size(served):
    _, server = served
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 2}
    assert _post(server, "/chat/completions", body, key=None).status_code == 401
    assert _post(server, "/chat/completions", body, key="wrong").status_code == 401
    bad = _post(server, "/chat/completions", b"{not json")
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
    unknown = _post(server, "/chat/completions", {**body, "frobnicate": 1})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "frobnicate"
    wrong = _post(server, "/chat/completions", {**body, "temperature": "hot"})
    assert wrong.status_code == 400 and "temperature" in wrong.json()["error"]["message"]
    tools = _post(server, "/chat/completions", {**body, "tools": [{"type": "function", "function": {"nom": "f"}}]})
    assert tools.status_code == 400 and tools.json()["error"]["param"] == "tools[0]"
    choice = _post(server, "/chat/completions", {**body, "tools": [WEATHER], "tool_choice": "get_time"})
    assert choice.status_code == 400 and choice.json()["error"]["param"] == "tool_choice"
    assert _post(server, "/chat/completions", {**body, "model": "other"}).status_code == 404
    too_long = _post(server, "/chat/completions", {**body, "max_tokens": 10**6})
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
    big = _post(server, "/chat/completions", b"x" * (9 * 2**20))
    assert big.status_code == 413
    assert httpx.get(server.url[:-3] + "/health").json() == {"status": "ok"}


def test_metrics(served, client):
    _, server = served
    client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=4)
    client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=4)
    text = httpx.get(server.url[:-3] + "/metrics").text
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values['kvboost_requests_total{route="chat",status="200"}'] >= 2
    assert values['kvboost_cached_tokens_total{kind="exact"}'] > 0
    assert values["kvboost_generation_tokens_total"] > 0
    assert values["kvboost_time_to_first_token_seconds_count"] >= 2
    assert values["kvboost_requests_waiting"] == 0 and values["kvboost_requests_running"] == 0


def _read_some(server, body, deltas: int, done: threading.Event | None = None) -> list[str]:
    """Open a stream and read `deltas` content events; then leave (close the connection), or with
    `done`, wait for it and read on to the end. Returns the events read."""
    got = []
    with httpx.stream("POST", server.url + "/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                got.append(line)
            if sum('"content":"' in event and '"content":""' not in event for event in got) == deltas:
                if done is None:
                    break
                done.wait(60)
    return got


def _wait_free(engine, timeout_s=5.0) -> int:
    deadline = time.monotonic() + timeout_s
    while engine.cache.pool.usage()["in_use"] and time.monotonic() < deadline:
        time.sleep(0.05)
    return engine.cache.pool.usage()["in_use"]


def test_client_disconnect_frees_blocks(served):
    engine, server = served
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 1000, "temperature": 0.8, "seed": 1,
            "stream": True, "min_tokens": 1000}
    generated = engine.stats()["generated_tokens"]
    _read_some(server, body, 2)
    assert _wait_free(engine) == 0                      # 1000 tokens would take far longer than 5 s
    assert engine.stats()["generated_tokens"] - generated < 200


@pytest.fixture
def tight(smol):
    """One running slot, no queue: a second request while one runs is refused."""
    engine = Engine(*smol, cache_bytes=64 * 2**20, max_running=1, max_waiting=0)
    server = Server(create_app(engine, model_name=MODEL, api_key=KEY), drain_timeout_s=30).start()
    yield engine, server
    server.stop(30)
    engine.close()


def test_queue_full_429_and_drain(tight):
    engine, server = tight
    long = {"model": MODEL, "messages": QUESTION, "max_tokens": 100, "min_tokens": 100, "temperature": 0.8, "seed": 2,
            "stream": True}
    release, results = threading.Event(), []
    reader = threading.Thread(target=lambda: results.append(_read_some(server, long, 1, release)))
    reader.start()
    deadline = time.monotonic() + 60
    while not engine.cache.pool.usage()["in_use"] and time.monotonic() < deadline:
        time.sleep(0.02)
    busy = _post(server, "/chat/completions", {"model": MODEL, "messages": QUESTION, "max_tokens": 2})
    assert busy.status_code == 429 and busy.headers["Retry-After"] == "1"
    assert busy.json()["error"]["code"] == "queue_full"
    server.drain()                                      # as SIGTERM: new requests refused, in-flight ones finish
    assert _refused_after_drain(server)
    release.set()
    reader.join(60)
    assert results and results[0][-1] == "data: [DONE]"
    finish = json.loads(results[0][-2][6:])["choices"][0]["finish_reason"]
    assert finish == "length"                           # all 100 tokens, not cut by the shutdown
    assert _wait_free(engine) == 0


def _refused_after_drain(server, timeout_s=10.0) -> bool:
    """A new request gets 503 (draining) or no connection (no longer listening) within timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if _post(server, "/chat/completions", {"model": MODEL, "messages": QUESTION, "max_tokens": 2}).status_code \
                    == 503:
                return True
        except httpx.ConnectError:
            return True
        time.sleep(0.05)
    return False


def test_requests_past_the_drain_timeout_are_answered_503_and_a_cut_body_is_499(smol):
    """Past --drain-timeout-s uvicorn cancelled the handlers mid-await: a plain-text 500 ("Internal
    Server Error"), a stream cut with no `error` event, "Exception in ASGI application" logged. A
    client that left while sending its body was counted as a server error (500)."""
    import logging
    import socket
    engine = Engine(*smol, cache_bytes=64 * 2**20, max_running=1)
    server = Server(create_app(engine, model_name=MODEL, api_key=KEY), drain_timeout_s=2).start()
    host, port = server.url.split("//")[1].split("/")[0].split(":")
    with socket.create_connection((host, int(port))) as sock:       # 1000 bytes announced, 14 sent, then gone
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                     + b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\": \"smo")
    metrics = server.url.removesuffix("/v1") + "/metrics"
    deadline = time.monotonic() + 10
    while 'status="499"' not in httpx.get(metrics).text and time.monotonic() < deadline:
        time.sleep(0.05)
    assert 'status="499"' in (text := httpx.get(metrics).text) and 'status="500"' not in text
    long = {"model": MODEL, "messages": QUESTION, "max_tokens": 3000, "min_tokens": 3000, "temperature": 0}
    results, logged = {}, []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger("uvicorn.error").addHandler(handler)

    def stream():
        with httpx.stream("POST", server.url + "/chat/completions", json={**long, "stream": True}, timeout=60,
                          headers={"Authorization": f"Bearer {KEY}"}) as response:
            results["stream"] = (response.status_code, [line for line in response.iter_lines() if line.strip()])
    readers = [threading.Thread(target=stream),
               threading.Thread(target=lambda: results.setdefault("whole", _post(server, "/chat/completions", long)))]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + 60
    while not engine.cache.pool.usage()["in_use"] and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.3)
    started = time.monotonic()
    try:
        server.stop(30)
    finally:
        logging.getLogger("uvicorn.error").removeHandler(handler)
    assert time.monotonic() - started < 10
    for reader in readers:
        reader.join(30)
    whole = results["whole"]
    assert whole.status_code == 503 and whole.json()["error"]["type"] == "server_error"
    assert "drain timeout" in whole.json()["error"]["message"]          # not the refusal of a late request
    status, lines = results["stream"]           # begun: an error event; still queued (max_running=1): a 503
    assert status in (200, 503) and "data: [DONE]" not in lines, (status, lines)
    assert '"server_error"' in lines[-1] and "drain timeout" in lines[-1], lines
    assert not [m for m in logged if "Exception in ASGI application" in m or "Cancel" in m], logged
    assert _wait_free(engine) == 0
    engine.close()


def test_a_pump_that_cannot_start_leaves_no_trace():
    """It was in the in-flight set before its thread started: one that failed to start stayed there,
    its request never stopped."""
    from kvboost_engine.serve.pump import Inflight, Pump

    class Stream:
        cancelled = False

        def cancel(self):
            self.cancelled = True
    inflight, stream = Inflight(), Stream()
    with pytest.raises(RuntimeError):           # no running event loop
        Pump(stream, 0.0, inflight=inflight)
    assert not inflight and stream.cancelled


def test_draining_app_answers_503(served):
    _, server = served
    state = server.app.state.kvboost
    state.draining = True
    try:
        refused = _post(server, "/chat/completions", {"model": MODEL, "messages": QUESTION, "max_tokens": 2})
        assert refused.status_code == 503
        assert httpx.get(server.url[:-3] + "/health").status_code == 503
    finally:
        state.draining = False


def test_logprobs(served, client):
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=5,
                                           logprobs=True, top_logprobs=2)
    entries = reply.choices[0].logprobs.content
    assert len(entries) == 5 and all(len(e.top_logprobs) == 2 for e in entries)
    assert "".join(e.token for e in entries) == reply.choices[0].message.content
    streamed = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=5,
                                              logprobs=True, stream=True)
    tokens = [e.token for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert tokens == [e.token for e in entries]


def test_command_line_serves_and_drains_on_sigterm(tmp_path):
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**__import__("os").environ, "KVBOOST_API_KEY": KEY}
    process = subprocess.Popen([sys.executable, "-m", "kvboost_engine.serve", "--port", str(port), "--max-running",
                                "2", "--cache-bytes", "64MiB", "--log-level", "warning"], env=env,
                               stderr=subprocess.PIPE, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(base + "/health").status_code == 200:
                    break
            except httpx.ConnectError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
            time.sleep(0.2)
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=3)
        assert reply.usage.completion_tokens == 3
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_forced_tool_call_matches_chat_kvboost(served, client):
    from kvboost_integrations.langchain import ChatKVBoost
    engine, server = served
    forced = {"type": "function", "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, temperature=0, max_tokens=40,
                                           tools=[WEATHER], tool_choice=forced)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
    local = ChatKVBoost(engine=engine, max_tokens=40).bind_tools([WEATHER], tool_choice="get_weather")
    assert local.invoke(ASK_WEATHER).tool_calls[0]["args"] == json.loads(call.function.arguments)
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, temperature=0, max_tokens=40,
                                                 tools=[WEATHER], tool_choice="required", stream=True))
    calls = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert calls and calls[0][0].function.name == "get_weather"
    assert json.loads(calls[0][0].function.arguments) == json.loads(call.function.arguments)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_tool_result_turn_and_chat_openai_tools(served, client):
    from langchain_openai import ChatOpenAI
    engine, server = served
    history = ASK_WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 degrees"}]
    reply = client.chat.completions.create(model=MODEL, messages=history, temperature=0, max_tokens=12,
                                           tools=[WEATHER])
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    from kvboost_integrations.langchain import ChatKVBoost
    same = [HumanMessage(ASK_WEATHER[0]["content"]),
            AIMessage("", tool_calls=[{"name": "get_weather", "args": {"city": "Paris"}, "id": "call_1"}]),
            ToolMessage("Sunny, 24 degrees", tool_call_id="call_1")]
    local = ChatKVBoost(engine=engine, max_tokens=12).bind_tools([WEATHER]).invoke(same)
    assert reply.usage.prompt_tokens == local.usage_metadata["input_tokens"]
    assert (reply.choices[0].message.content or "") == local.content
    theirs = ChatOpenAI(base_url=server.url, api_key=KEY, model=MODEL, temperature=0, max_tokens=40, max_retries=0)
    message = theirs.bind_tools([WEATHER], tool_choice="get_weather").invoke(ASK_WEATHER)
    assert message.tool_calls[0]["name"] == "get_weather" and set(message.tool_calls[0]["args"]) == {"city"}


def test_queue_timeout_is_429(smol):
    """A request that waited past queue_timeout_s for a running slot: 429 (QueueFullError), not a 400."""
    engine = Engine(*smol, cache_bytes=0, max_running=1, max_waiting=4, queue_timeout_s=0.3)
    with Server(create_app(engine, model_name=MODEL)) as server:
        release, results = threading.Event(), []
        long = {"model": MODEL, "messages": QUESTION, "max_tokens": 100, "min_tokens": 100, "stream": True}
        reader = threading.Thread(target=lambda: results.append(_read_some(server, long, 1, release)))
        reader.start()
        deadline = time.monotonic() + 60
        while not engine.cache.pool.usage()["in_use"] and time.monotonic() < deadline:
            time.sleep(0.02)
        waited = _post(server, "/chat/completions", {"model": MODEL, "messages": QUESTION, "max_tokens": 2}, key=None)
        release.set()
        reader.join(60)
    engine.close()
    assert waited.status_code == 429 and "waited" in waited.json()["error"]["message"]
    assert results[0][-1] == "data: [DONE]"


def test_what_the_template_or_the_schema_cannot_take_is_a_400(served):
    _, server = served
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 2}
    cases = [({"chat_template_kwargs": {"tokenize": True}}, "cannot set tokenize"),
             ({"chat_template_kwargs": {"chat_template": "{{ 7 * 7 }}"}}, "chat_template is not accepted"),
             ({"response_format": {"type": "json_schema", "json_schema": {
                 "name": "x", "schema": {"type": "object", "properties": "x"}}}}, "must be an object of schemas"),
             ({"response_format": {"type": "json_schema", "json_schema": {
                 "name": "x", "schema": {"anyOf": 5}}}}, "must be a list of schemas")]
    for extra, message in cases:
        refused = _post(server, "/chat/completions", {**body, **extra})
        assert refused.status_code == 400 and message in refused.json()["error"]["message"], (extra, refused.text)
    deep = _post(server, "/chat/completions", b"[" * 100_000 + b"]" * 100_000)
    assert deep.status_code == 400 and "nests JSON deeper" in deep.json()["error"]["message"]
    assert _post(server, "/chat/completions", {**body, "top_k": -1}).status_code == 200     # vLLM's "off"


def test_field_values_are_refused_under_the_clients_names():
    """A bad value is refused naming the field the client sent (max_tokens, not the engine's max_new_tokens),
    with it as the error's param; template booleans are booleans (Jinja reads "false" as true)."""
    from kvboost_engine.serve.protocol import BadRequest, engine_parameters, parse_chat
    msgs = [{"role": "user", "content": "Q"}]
    cases = [({"max_tokens": 0}, "max_tokens"), ({"max_completion_tokens": -2}, "max_completion_tokens"),
             ({"min_tokens": -1}, "min_tokens"), ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
             ({"top_k": -5}, "top_k"), ({"seed": "x"}, "seed"), ({"frequency_penalty": 3}, "frequency_penalty"),
             ({"logit_bias": {"a": 1}}, "logit_bias"), ({"stop": [1]}, "stop"),
             ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
             ({"chat_template_kwargs": {"add_generation_prompt": "false"}}, "chat_template_kwargs.add_generation_prompt"),
             ({"chat_template_kwargs": {"continue_final_message": 1}}, "chat_template_kwargs.continue_final_message")]
    for fields, param in cases:
        with pytest.raises(BadRequest) as refused:
            parse_chat({"messages": msgs, **fields}, engine_parameters())
        assert refused.value.param == param and str(refused.value).startswith(param), fields


def test_template_switches_are_booleans_on_every_route(served):
    """/tokenize read a top-level continue_final_message "false" as true (33 tokens, not 35); a null
    switch is unset, not refused; the engine checks continue_final_message in template_kwargs too."""
    engine, server = served
    url, headers = server.url.removesuffix("/v1") + "/tokenize", {"Authorization": f"Bearer {KEY}"}
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    count = lambda body: httpx.post(url, json={"messages": msgs, **body}, headers=headers, timeout=30)  # noqa: E731
    plain = count({}).json()["count"]
    assert count({"continue_final_message": None, "add_generation_prompt": None}).json()["count"] == plain
    for body in ({"continue_final_message": "false"}, {"add_generation_prompt": "no"},
                 {"chat_template_kwargs": {"continue_final_message": 1}}):
        refused = count(body)
        assert refused.status_code == 400 and "must be a boolean" in refused.json()["error"]["message"], body
    chat = {"model": MODEL, "messages": QUESTION, "max_tokens": 1, "chat_template_kwargs": {"add_generation_prompt": None}}
    assert _post(server, "/chat/completions", chat).status_code == 200
    with pytest.raises(InputError, match="continue_final_message must be a bool"):
        engine.encode_messages(msgs, continue_final_message="yes")


def test_a_streamed_chunk_carries_usage_null_when_usage_is_asked(served):
    """OpenAI's include_usage: every chunk but the last has "usage": null; without it, no usage key."""
    _, server = served
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 3, "stream": True, "temperature": 0}
    for include, route in ((True, "/chat/completions"), (False, "/chat/completions"), (True, "/completions")):
        sent = {**body, "stream_options": {"include_usage": True}} if include else body
        if route == "/completions":
            sent = {k: v for k, v in sent.items() if k != "messages"} | {"prompt": "Paris is"}
        lines = _post(server, route, sent).text.splitlines()
        chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        assert len(chunks) >= 3
        if include:
            assert all("usage" in c and c["usage"] is None for c in chunks[:-1]) and chunks[-1]["usage"]
        else:
            assert all("usage" not in c for c in chunks)


def test_protocol_maps_and_refuses_fields():
    from kvboost_engine.serve.protocol import BadRequest, engine_parameters, parse_chat, parse_completion
    accepted = engine_parameters()
    doc = {"role": "user", "content": [{"type": "document", "text": "D"}, {"type": "text", "text": "Q"}]}
    call = parse_chat({"messages": [doc], "max_completion_tokens": 5, "min_tokens": 2, "stop": ["\n"], "seed": 3,
                       "repetition_penalty": 1.1, "repeat_penalty": 1.1, "repeat_last_n": -1,
                       "stream": True, "stream_options": {"include_usage": True}}, accepted)
    assert call.payload == [doc] and call.include_usage and call.stream
    assert call.params == {"temperature": 1.0, "max_new_tokens": 5, "min_new_tokens": 2, "stop": ["\n"], "seed": 3,
                           "repetition_penalty": 1.1}
    assert parse_completion({"prompt": ["P"], "logprobs": 2}, accepted).params["top_logprobs"] == 2
    assert parse_chat({"messages": [doc], "top_k": -1}, accepted).params["top_k"] == 0      # vLLM's "off"
    bad = [({"messages": [doc], "n": 2}, "n"), ({"messages": [doc], "n": True}, "n"),
           ({"messages": [doc], "stream_options": {"include_usage": True}}, "stream_options"),
           ({"messages": [doc], "stream": True, "stream_options": {"x": 1}}, "stream_options.x"),
           ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content[0]"),
           ({"messages": []}, "messages"), ({"messages": [doc], "repeat_penalty": 1.3}, "repeat_penalty"),
           ({"messages": [doc], "response_format": {"type": "yaml"}}, "response_format.type"),
           ({"messages": [doc], "max_tokens": 2, "max_completion_tokens": 2}, "max_completion_tokens")]
    for body, param in bad:
        with pytest.raises(BadRequest) as refused:
            parse_chat(body, accepted)
        assert param is None or refused.value.param == param, body
    with pytest.raises(BadRequest, match="logit_bias is not supported by this engine"):
        parse_chat({"messages": [doc], "logit_bias": {"5": 1}}, accepted - {"logit_bias"})
    with pytest.raises(BadRequest, match="completions API takes logprobs"):         # it was ignored
        parse_completion({"prompt": "P", "top_logprobs": 2}, accepted)
    with pytest.raises(BadRequest) as refused:
        parse_completion({"prompt": "P", "echo": True}, accepted)
    assert refused.value.param == "echo"


def test_concurrent_clients_share_one_engine(served, client):
    """Several clients at once (continuous batching): each greedy reply as the engine gives it alone."""
    engine, _ = served
    questions = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
                 for q in ("Name a color.", "Name a fruit.", "Name a country.")]
    expected = [engine.chat(q, max_new_tokens=8).text for q in questions]
    replies = [None] * len(questions)

    def ask(i):
        replies[i] = client.chat.completions.create(model=MODEL, messages=questions[i], temperature=0, max_tokens=8)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(questions))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert [r.choices[0].message.content for r in replies] == expected
    assert all(r.usage.prompt_tokens_details.cached_tokens > 0 for r in replies)   # the shared system prompt


def _metric(server, name: str) -> int:
    text = httpx.get(server.url.removesuffix("/v1") + "/metrics", timeout=30).text
    return int(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def test_a_client_that_leaves_a_json_request_cancels_it(served):
    """The disconnect check ran only when no token came for 0.25 s: a non-streaming request whose
    client left decoded on to max_tokens; its tokens were not counted in /metrics either."""
    engine, server = served
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 1000, "min_tokens": 1000, "temperature": 0.8,
            "seed": 3}
    generated, counted = engine.stats()["generated_tokens"], _metric(server, "kvboost_generation_tokens_total")
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=1.0)
    assert _wait_free(engine) == 0                      # 1000 tokens would take far longer than 5 s
    done = engine.stats()["generated_tokens"] - generated
    assert 0 < done < 400
    deadline = time.monotonic() + 5
    while _metric(server, "kvboost_generation_tokens_total") == counted and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _metric(server, "kvboost_generation_tokens_total") - counted == done


def test_openai_fields_and_routes_the_client_uses(served, client):
    first = client.chat.completions.create(
        model=MODEL, messages=[{"role": "developer", "content": SYSTEM}, *QUESTION[1:]], temperature=0, max_tokens=4,
        safety_identifier="user-1", prompt_cache_key="support")
    assert first.choices[0].message.content == client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=4).choices[0].message.content
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("another-model")


def test_streamed_logprobs_end_where_the_reply_does(served, client):
    """The engine's last delta can be empty text carrying the last tokens' logprobs (held back by
    a stop string's prefix): the stream dropped it, so streamed and whole replies disagreed."""
    for stop in ([","], ["Par"], ["The"]):
        whole = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=8,
                                               logprobs=True, stop=stop)
        streamed = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=8,
                                                  logprobs=True, stop=stop, stream=True)
        tokens = [e.token for c in streamed if c.choices and c.choices[0].logprobs
                  for e in c.choices[0].logprobs.content]
        assert tokens == [e.token for e in whole.choices[0].logprobs.content], stop


def test_request_sizes_that_would_stall_every_request_are_a_400(served):
    """Tool names were checked in quadratic time on the event loop (10,000 tools: the server
    stalled 3 s); every token is checked against every stop string on the shared scheduler thread."""
    _, server = served
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 1}
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]
    too_many = _post(server, "/chat/completions", {**body, "tools": tools, "tool_choice": "none"})
    assert too_many.status_code == 400 and "at most 128" in too_many.json()["error"]["message"]
    twice = _post(server, "/chat/completions", {**body, "tools": tools[:2] + tools[:1], "tool_choice": "none"})
    assert twice.status_code == 400 and "repeats the name 'f0'" in twice.json()["error"]["message"]
    string = [{"type": "function", "function": {"name": "s", "parameters": {"type": "string"}}}]   # a forced call
    forced = _post(server, "/chat/completions", {**body, "tools": string, "tool_choice": "required"})  # came back as text
    assert forced.status_code == 400 and forced.json()["error"]["param"] == "tools[0].function.parameters"
    assert "must be an object schema" in forced.json()["error"]["message"]
    stops = _post(server, "/chat/completions", {**body, "stop": [f"s{i}" for i in range(17)]})
    assert stops.status_code == 400 and stops.json()["error"]["param"] == "stop"
    long = _post(server, "/chat/completions", {**body, "stop": "x" * 1001})        # one string, not a list
    assert long.status_code == 400 and long.json()["error"]["param"] == "stop"
    assert _post(server, "/chat/completions", {**body, "stop": [f"s{i}" for i in range(16)]}).status_code == 200


def test_without_max_tokens_the_reply_stops_at_the_window(smol):
    """OpenAI's default: a prompt that fits is answered up to the window's end (it was refused for a
    default of 256 new tokens the client never asked for)."""
    from transformers import AutoTokenizer
    from kvboost_engine.loading import default_model_dir
    from tiny_models import tiny_model
    engine = Engine(tiny_model("llama", max_position_embeddings=256), AutoTokenizer.from_pretrained(default_model_dir()))
    with Server(create_app(engine, model_name=MODEL)) as server:
        prompt = "one two three four five " * 40
        room = 256 - engine.count_tokens(prompt)
        reply = httpx.post(server.url + "/completions", json={"prompt": prompt, "temperature": 0}, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] <= room and 0 < room < 256
        full = httpx.post(server.url + "/completions", json={"prompt": prompt * 2}, timeout=60)
        assert full.status_code == 400 and full.json()["error"]["code"] == "context_length_exceeded"
    engine.close()


def test_unknown_routes_and_bad_stream_options_answer_in_openai_shape(served):
    _, server = served
    missing = _post(server, "/embeddings", {"input": "x"})
    assert missing.status_code == 404 and "no route" in missing.json()["error"]["message"]
    wrong = httpx.get(server.url + "/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "unknown_method"
    assert wrong.headers["allow"] == "POST"
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 1, "stream": True,
            "stream_options": {"include_usage": "no"}}
    refused = _post(server, "/chat/completions", body)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "stream_options.include_usage"
    body["stream_options"] = {"include_usage": None}                             # null: not set
    assert _post(server, "/chat/completions", body).status_code == 200


def test_the_command_tells_a_busy_port_before_loading_and_errors_in_one_line(capsys, monkeypatch):
    """A busy port was found after the model's whole load (minutes for a large one), then a
    traceback; a model not found or a bad option was a traceback too."""
    import socket
    from kvboost_engine.serve.__main__ import main, parser
    held = socket.create_server(("127.0.0.1", 0))
    loads = []
    monkeypatch.setattr(Engine, "from_pretrained", classmethod(lambda cls, *a, **k: loads.append(a)))
    try:
        assert main(["--port", str(held.getsockname()[1])]) == 1
    finally:
        held.close()
    assert loads == [] and capsys.readouterr().err.startswith("kvboost: cannot listen on 127.0.0.1:")
    monkeypatch.undo()
    assert main(["--model", "/nonexistent/model", "--port", "0"]) == 1
    assert capsys.readouterr().err.strip() == "kvboost: model path '/nonexistent/model' does not exist"
    with pytest.raises(SystemExit):
        parser().parse_args(["--port", "70000"])
    assert parser().parse_args(["--drain-timeout-s", "0.5"]).drain_timeout_s == 0.5
