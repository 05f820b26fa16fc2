"""Counting tokens for a remote model: the server's own tokenizer, or a local one if given.

vLLM, llama-server and our own server (kvboost_engine.serve, in vLLM's shape) serve
`POST /tokenize` (different request fields); chat prompts are counted with the server's chat
template (vLLM and ours tokenize messages, ours with document parts as the chat request sends
them; llama-server applies its template with /apply-template first). A server of another kind has no tokenizer endpoint: its
counts are estimated at 4 characters per token (pass `tokenizer=` for exact counts).

`ServerTokenizer` can be called like an HF tokenizer (`tok(text)["input_ids"]`), which is what
the framework classes use; results are cached per text (the same node texts are counted often).
"""
from __future__ import annotations

import json
import math
import threading
from collections import OrderedDict
from collections.abc import Callable

CHARS_PER_TOKEN = 4        # the estimate for servers without /tokenize
MESSAGE_OVERHEAD = 8       # estimated template tokens per message, same case
VLLM_SHAPE = ("vllm", "kvboost")    # kinds whose /tokenize takes vLLM's fields


class ServerTokenizer:
    """Text -> token ids through `post(path, body)` on a server of `kind` ("vllm", "llamacpp",
    "kvboost", other)."""

    def __init__(self, post: Callable[[str, dict], dict], kind: str, model: str, capacity: int = 4096):
        self._post = post
        self.kind = kind
        self.model = model
        self.exact = kind in ("vllm", "llamacpp", "kvboost")
        self._cache: OrderedDict[str, list[int]] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def __call__(self, text: str, add_special_tokens: bool = False, **_) -> dict:
        return {"input_ids": self.encode(text)}

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` alone (no special tokens added)."""
        with self._lock:
            if text in self._cache:
                self._cache.move_to_end(text)
                return self._cache[text]
        ids = self._tokenize(text)
        with self._lock:
            self._cache[text] = ids
            while len(self._cache) > self._capacity:
                self._cache.popitem(last=False)
        return ids

    def _tokenize(self, text: str) -> list[int]:
        if not text:
            return []
        if self.kind in VLLM_SHAPE:
            return list(self._post("/tokenize", {"model": self.model, "prompt": text,
                                                 "add_special_tokens": False})["tokens"])
        if self.kind == "llamacpp":
            return list(self._post("/tokenize", {"content": text, "add_special": False,
                                                 "parse_special": False})["tokens"])
        return [0] * math.ceil(len(text) / CHARS_PER_TOKEN)

    def count_chat(self, messages: list[dict], tools: list[dict] | None = None, template_kwargs: dict | None = None) -> int:
        """Prompt tokens of wire `messages` (and `tools`, and chat-template kwargs) with the server's
        chat template and generation prompt."""
        with_tools = {"tools": tools} if tools else {}
        if template_kwargs:                 # vLLM's /tokenize and llama-server's /apply-template read it
            with_tools["chat_template_kwargs"] = dict(template_kwargs)
        if self.kind in VLLM_SHAPE:
            return int(self._post("/tokenize", {"model": self.model, "messages": messages,
                                                "add_generation_prompt": True, **with_tools})["count"])
        if self.kind == "llamacpp":
            prompt = self._post("/apply-template", {"messages": messages, **with_tools})["prompt"]
            return len(self._post("/tokenize", {"content": prompt, "add_special": True,
                                               "parse_special": True})["tokens"])
        tool_text = "".join(json.dumps(tool) for tool in tools or ())
        return (sum(len(self.encode(m.get("content") or "")) + MESSAGE_OVERHEAD for m in messages)
                + len(self.encode(tool_text)))


def count_chat_local(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                     template_kwargs: dict | None = None) -> int:
    """Prompt tokens of wire `messages` (and `tools`, template kwargs) with a local HF tokenizer's chat template."""
    ids = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True, tokenize=True,
                                        **(template_kwargs or {}))
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return len(ids)


def encode_local(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
