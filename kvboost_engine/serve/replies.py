"""Response bodies in OpenAI's formats: chat.completion, chat.completion.chunk, text_completion,
usage (with `prompt_tokens_details.cached_tokens`), errors; and server-sent-event framing."""
from __future__ import annotations

import codecs
import json
import time
import uuid

from ..request.generation import Generation


class Reply:
    """Builds the bodies of one request's reply (one id and creation time for all its chunks)."""

    def __init__(self, kind: str, model: str, tools=None, usage_null: bool = False):
        self.kind = kind
        self.model = model
        self.tools = tools              # a tools.ToolReply when the model may call tools
        self.usage_null = usage_null    # include_usage: every chunk but the last carries "usage": null (OpenAI's)
        self.offsets = TextOffsets()    # completions' text_offset, going on from chunk to chunk
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    # ---- whole replies ------------------------------------------------------------------
    def complete(self, gen: Generation) -> dict:
        """The non-streamed reply."""
        if self.kind == "chat":
            message, finish = {"role": "assistant", "content": gen.text}, finish_reason(gen)
            if self.tools is not None:
                shown = self.tools.feed(gen.text)
                rest, calls = self.tools.finish(cut=gen.finish_reason == "length")
                message["content"] = (shown + rest) or (None if calls else "")
                if calls:
                    message["tool_calls"], finish = calls, "tool_calls"
            choice = {"index": 0, "message": message, "logprobs": chat_logprobs(gen.logprobs), "finish_reason": finish}
            return {**self._head("chat.completion"), "choices": [choice], "usage": usage(gen)}
        choice = {"index": 0, "text": gen.text, "logprobs": completion_logprobs(gen.logprobs, TextOffsets()),
                  "finish_reason": finish_reason(gen)}
        return {**self._head("text_completion"), "choices": [choice], "usage": usage(gen)}

    # ---- streamed chunks ----------------------------------------------------------------
    def first_chunk(self) -> dict | None:
        """A chat stream opens with the assistant role (OpenAI's first chunk); completions do not."""
        if self.kind != "chat":
            return None
        return self._chunk({"role": "assistant", "content": ""}, None)

    def delta_chunks(self, text: str) -> list[dict]:
        """The chunks for a text delta (its tokens' logprobs with it when it has them); none while
        text that may begin a tool call is held back."""
        entries = getattr(text, "logprobs", None)
        if self.kind != "chat":
            return [self._completion_chunk(str(text), None, completion_logprobs(entries, self.offsets))]
        if self.tools is not None:
            text = self.tools.feed(str(text))
        return [self._chunk({"content": str(text)}, None, chat_logprobs(entries))] if text or entries else []

    def end_chunks(self, gen: Generation) -> list[dict]:
        """The chunks after the last delta: held-back text, the tool calls, then the finish_reason."""
        if self.kind != "chat":
            return [self._completion_chunk("", finish_reason(gen))]
        chunks, finish = [], finish_reason(gen)
        if self.tools is not None:
            rest, calls = self.tools.finish(cut=gen.finish_reason == "length")
            if rest:
                chunks.append(self._chunk({"content": rest}, None))
            if calls:
                chunks.append(self._chunk({"tool_calls": calls}, None))
                finish = "tool_calls"
        return [*chunks, self._chunk({}, finish)]

    def usage_chunk(self, gen: Generation) -> dict:
        """stream_options.include_usage: a last chunk with no choices and the usage."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage(gen)}

    def _chunk(self, delta: dict, finish: str | None, logprobs: dict | None = None) -> dict:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return self._with_usage({**self._head("chat.completion.chunk"), "choices": [choice]})

    def _completion_chunk(self, text: str, finish: str | None, logprobs: dict | None = None) -> dict:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return self._with_usage({**self._head("text_completion"), "choices": [choice]})

    def _with_usage(self, chunk: dict) -> dict:
        if self.usage_null:
            chunk["usage"] = None
        return chunk


def finish_reason(gen: Generation) -> str:
    """OpenAI's finish_reason: "length" when max_tokens cut the reply, else "stop"."""
    return "length" if gen.finish_reason == "length" else "stop"


def usage(gen: Generation) -> dict:
    """Token counts; cached_tokens are the prompt tokens whose KV came from the cache (exact and moved)."""
    return {"prompt_tokens": gen.prompt_tokens, "completion_tokens": gen.completion_tokens,
            "total_tokens": gen.prompt_tokens + gen.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": gen.reused_tokens, "cached_exact_tokens": gen.reused_exact,
                                      "cached_moved_tokens": gen.reused_moved}}


def chat_logprobs(entries: list[dict] | None) -> dict | None:
    """Our logprob entries (already OpenAI's chat items) as a choice's `logprobs`."""
    return None if entries is None else {"content": entries}


class TextOffsets:
    """Where each token starts in the reply text, in characters, counted on over every token before it
    (streamed: from the characters already sent). A token that is part of a character (its text
    U+FFFD) adds nothing until the token that completes the character: its bytes are decoded, not
    its text counted."""

    def __init__(self):
        self.chars = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def of(self, entries: list[dict]) -> list[int]:
        offsets = []
        for entry in entries:
            offsets.append(self.chars)
            raw = entry.get("bytes")
            self.chars += len(self._decoder.decode(bytes(raw) if raw is not None else entry["token"].encode()))
        return offsets


def completion_logprobs(entries: list[dict] | None, offsets: TextOffsets) -> dict | None:
    """Our logprob entries in the completions API's legacy format (`text_offset` from `offsets`)."""
    if entries is None:
        return None
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e.get("top_logprobs", [])} for e in entries],
            "text_offset": offsets.of(entries)}


def error_body(message: str, *, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def sse(payload: dict | str) -> bytes:
    """One server-sent event: `data: <json>` and a blank line (`data: [DONE]` for the end)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()
