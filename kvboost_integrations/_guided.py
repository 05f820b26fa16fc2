"""Schema-guided JSON: output that always parses and matches the schema.

The structure (braces, keys, commas, quotes) is written by us; the model writes the values.
Strings are generated freely up to their closing quote (and streamed); numbers, booleans,
enums and tool names are chosen token by token among the tokens the schema allows, from the
model's own next-token logits (constrained decoding, greedy). Every step is an ordinary
engine request on the same chat with the JSON so far as an assistant prefill, so each step
reuses the KV of the one before.

Framework-neutral: the LangChain and LlamaIndex adapters build on `json_stream` and
`tool_call_stream`.
"""
from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Generator

import torch

from kvboost_engine import Generation, GenerationStream, InputError

from ._jsonschema import finish_number, resolve, type_of
from ._vocab import Vocabulary

CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}
STRING_TOKENS = 32          # most tokens one string value may take
NUMBER_TOKENS = 12
MAX_ITEMS = 5
_INT_PREFIX = re.compile(r"-?(0|[1-9]\d*)?")
_NUM_PREFIX = re.compile(r"-?((0|[1-9]\d*)(\.\d*)?)?")
_INT_DONE = re.compile(r"-?(0|[1-9]\d*)")
_NUM_DONE = re.compile(r"-?(0|[1-9]\d*)(\.\d+)?")


class _Cancelled(Exception):
    pass


class JsonGuide:
    """Writes one JSON value for `schema` as the continuation of an assistant turn."""

    def __init__(self, engine, vocab: Vocabulary, messages: list[dict], params: dict,
                 cancel: threading.Event, root_schema: dict, template_kwargs: dict | None = None):
        self.engine, self.vocab, self.messages = engine, vocab, messages
        self.template_kwargs = {**(template_kwargs or {}), **CONTINUE}
        self.params = {k: v for k, v in params.items() if k in ("temperature", "top_p", "top_k", "seed")}
        self.budget = int(params.get("max_new_tokens", 256))
        self.cancel, self.root = cancel, root_schema
        self.text = ""              # assistant text written so far (seen by the model)
        self.pending = ""           # a value being chosen: seen by the model, not yet yielded
        self.first: Generation | None = None
        self.first_token_s: float | None = None
        self.started = time.perf_counter()
        self.truncated = False

    # ---- plumbing -----------------------------------------------------------------------
    def emit(self, text: str) -> Generator[str, None, None]:
        self.text += text
        self.pending = ""
        yield text

    def _messages(self) -> list[dict]:
        return [*self.messages, {"role": "assistant", "content": self.text + self.pending}]

    def spend(self) -> bool:
        """Take one token from the budget; False when it is spent."""
        if self.cancel.is_set():
            raise _Cancelled
        if self.budget <= 0:
            self.truncated = True
            return False
        self.budget -= 1
        return True

    def logits(self) -> torch.Tensor:
        logits = self.engine.next_token_logits(messages=self._messages(), template_kwargs=self.template_kwargs)
        if self.first_token_s is None:
            self.first_token_s = time.perf_counter() - self.started
        return logits

    # ---- values -------------------------------------------------------------------------
    def value(self, schema: dict, depth: int = 0) -> Generator[str, None, None]:
        """Write one value of `schema`."""
        schema = self.resolve(schema)
        if depth > 16:
            raise InputError("schema nests deeper than 16 levels")
        if "const" in schema:
            yield from self.emit(json.dumps(schema["const"], ensure_ascii=False))
        elif "enum" in schema:
            yield from self.choose([json.dumps(v, ensure_ascii=False) for v in schema["enum"]])
        else:
            kind = type_of(schema)
            if kind == "object":
                yield from self.object(schema, depth)
            elif kind == "array":
                yield from self.array(schema, depth)
            elif kind in ("integer", "number"):
                yield from self.number(schema, integer=kind == "integer")
            elif kind == "boolean":
                yield from self.choose(["true", "false"])
            elif kind == "null":
                yield from self.emit("null")
            else:
                yield from self.string()

    def object(self, schema: dict, depth: int) -> Generator[str, None, None]:
        yield from self.emit("{")
        for index, (name, sub) in enumerate((schema.get("properties") or {}).items()):
            yield from self.emit((", " if index else "") + json.dumps(name, ensure_ascii=False) + ": ")
            yield from self.value(sub, depth + 1)
        yield from self.emit("}")

    def array(self, schema: dict, depth: int) -> Generator[str, None, None]:
        items = self.resolve(schema.get("items") or {})
        low = int(schema.get("minItems", 0))
        high = max(min(int(schema.get("maxItems", MAX_ITEMS)), MAX_ITEMS), low)
        yield from self.emit("[")
        count = 0
        while count < high and (count < low or self._another_item(count, items)):
            if count:
                yield from self.emit(", ")
            yield from self.value(items, depth + 1)
            count += 1
        yield from self.emit("]")

    def _another_item(self, count: int, items: dict) -> bool:
        """Let the model choose between closing the array and writing one more item."""
        opener = {"string": '"', "object": "{", "array": "["}.get(type_of(items))
        if count == 0 and opener is None:
            return True                 # scalars have no single opening character to weigh
        return pick_option(self, ["]", "," if count else opener]) != "]"

    def string(self) -> Generator[str, None, None]:
        yield from self.emit('"')
        limit = min(STRING_TOKENS, max(1, self.budget // 2), self.budget)
        if self.cancel.is_set():
            raise _Cancelled
        if limit > 0:
            stream = self.engine.stream_chat(self._messages(), template_kwargs=self.template_kwargs, stop=['"', "\n"],
                                             max_new_tokens=limit, **self.params)
            for delta in stream:
                if self.cancel.is_set():
                    stream.cancel()
                if self.first_token_s is None:
                    self.first_token_s = time.perf_counter() - self.started
                yield from self.emit(json.dumps(delta, ensure_ascii=False)[1:-1])
            gen = stream.generation
            self.first = self.first or gen
            self.budget -= gen.completion_tokens
            if gen.finish_reason == "cancelled":
                raise _Cancelled
            self.truncated |= gen.finish_reason == "length"
        else:
            self.truncated = True
        yield from self.emit('"')

    def number(self, schema: dict, *, integer: bool) -> Generator[str, None, None]:
        prefix_re, done_re = (_INT_PREFIX, _INT_DONE) if integer else (_NUM_PREFIX, _NUM_DONE)
        digits = ""
        for _ in range(NUMBER_TOKENS):
            if not self.spend():
                break
            logits = self.logits()
            best = _best_number_token(self.vocab, logits, digits, prefix_re)
            complete = done_re.fullmatch(digits) is not None
            stop = complete and self.vocab.number_end.numel() and float(logits[self.vocab.number_end].max()) > (
                best[0] if best else float("-inf"))
            if best is None or stop:
                break
            digits += self.vocab.texts[best[1]]
            self.pending = digits
        yield from self.emit(finish_number(digits, integer, schema))

    def choose(self, options: list[str]) -> Generator[str, None, None]:
        """Write the option the model prefers, token by token among the options' spellings."""
        yield from self.emit(pick_option(self, options))

    # ---- schema -------------------------------------------------------------------------
    def resolve(self, schema: dict) -> dict:
        return resolve(self.root, schema)

    def generation(self, reason: str, tail: str = "") -> Generation:
        text = self.text + tail
        ids = self.engine.tokenizer(text, add_special_tokens=False)["input_ids"]
        prompt_tokens = self.engine.count_tokens(self.messages)
        first = self.first or Generation()
        reused = min(first.reused_tokens, prompt_tokens)
        return Generation(text=text, token_ids=list(ids), finish_reason=reason, prompt_tokens=prompt_tokens,
                          reused_tokens=reused, reused_exact=min(first.reused_exact, reused),
                          reused_moved=min(first.reused_moved, reused), recomputed=min(first.recomputed, reused),
                          ttft_s=self.first_token_s or 0.0, total_s=time.perf_counter() - self.started)


def pick_option(guide: JsonGuide, options: list[str]) -> str:
    """Pick one of `options` (distinct strings) from the model's logits; writes nothing."""
    live, consumed = list(options), ""
    while len(live) > 1 and not any(o == consumed for o in live):
        if not guide.spend():
            break
        logits = guide.logits()
        best = None
        for option in live:
            for token_id, piece, _ in guide.vocab.prefix_tokens(option[len(consumed):], allow_space=False):
                score = float(logits[token_id])
                if best is None or score > best[0]:
                    best = (score, piece)
        if best is None:
            break
        consumed += best[1]
        live = [o for o in live if o.startswith(consumed)]
        guide.pending = consumed
    guide.pending = ""
    exact = [o for o in live if o == consumed]
    return (exact or live or options)[0]


def _best_number_token(vocab: Vocabulary, logits: torch.Tensor, digits: str, prefix_re) -> tuple | None:
    order = torch.argsort(logits[vocab.numeric], descending=True)
    for index in order.tolist():
        token_id = int(vocab.numeric[index])
        candidate = digits + vocab.texts[token_id]
        if len(candidate) <= 15 and prefix_re.fullmatch(candidate):
            return float(logits[token_id]), token_id
    return None


def _run(guide: JsonGuide, body, tail: str) -> Generator[str, None, Generation]:
    try:
        yield from body
        yield from guide.emit(tail)
    except _Cancelled:
        return guide.generation("cancelled")
    return guide.generation("length" if guide.truncated else "stop")


def json_stream(engine, vocab: Vocabulary, messages: list[dict], schema: dict, *,
                template_kwargs: dict | None = None, **params) -> GenerationStream:
    """Stream a JSON value matching `schema` as the assistant's answer to `messages`.

    params: max_new_tokens (the budget of model-chosen tokens; when it runs out, the value is
    closed early and still parses, finish_reason "length"), temperature, top_p, top_k, seed
    (used for free text; constrained choices are greedy). Stop strings do not apply.
    """
    cancel = threading.Event()
    guide = JsonGuide(engine, vocab, messages, params, cancel, schema, template_kwargs)
    if type_of(guide.resolve(schema)) not in ("object", "array"):
        raise InputError("structured output needs a JSON schema whose top level is an object or an array")
    return GenerationStream(_run(guide, guide.value(schema), ""), cancel)


def tool_call_stream(engine, vocab: Vocabulary, messages: list[dict], tools: dict[str, dict], *,
                     prefix: str, suffix: str, template_kwargs: dict | None = None, **params) -> GenerationStream:
    """Stream `prefix{"name": <tool>, "arguments": {...}}suffix` for one of `tools` (name -> schema);
    the model picks the tool and writes the arguments. params as for `json_stream`."""
    if not tools:
        raise InputError("a forced tool call needs at least one tool")
    cancel = threading.Event()
    guide = JsonGuide(engine, vocab, messages, params, cancel, {}, template_kwargs)

    def body():
        yield from guide.emit(prefix + '{"name": ')
        name = json.loads(pick_option(guide, [json.dumps(n, ensure_ascii=False) for n in tools]))
        yield from guide.emit(json.dumps(name, ensure_ascii=False) + ', "arguments": ')
        guide.root = tools[name]
        yield from guide.value(tools[name])
        yield from guide.emit("}")

    return GenerationStream(_run(guide, body(), suffix), cancel)

