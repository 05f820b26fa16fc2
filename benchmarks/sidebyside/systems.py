"""The systems compared side by side, each built from the same model object and tokenizer.

Every system answers a `workloads.Request` greedily and reports the same measurements:

  ttft_s        from the call until the first generated token exists. Token times come from a
                forward hook on the model's lm_head (one call per generated token for plain
                transformers, the pipelines and our engine); kvboost 0.9.0 also runs lm_head
                while repairing reused KV, so its times come from its own `on_token` callback.
  total_s       the whole call, prompt formatting and detokenization included.
  decode_tok_s  (generated tokens - 1) / (last token time - first token time).
  hit rate      prompt tokens whose KV came from a cache / prompt tokens (0 without a cache).

Peers get the model with its own attention implementation (sdpa); our systems switch it to
kvboost's attention function for their calls (its fallback would otherwise sit under the peers).

A model without a chat template (`--model gemma3-270m`, a base model) runs in completion mode:
every system gets the request as one plain-text transcript (workloads.transcript_text) through
its completion call, ours as transcript segments with the documents as their own segments
(`engine.generate`). The llama.cpp rows have no completion path yet and report that.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from importlib import metadata

import torch

from .workloads import Request, flat_messages, transcript, transcript_text

GIB = 1024**3


@dataclass(slots=True)
class Reply:
    text: str
    prompt_tokens: int
    reused_tokens: int = 0
    reused_exact: int = 0
    reused_moved: int = 0


class TokenClock:
    """Times at which generated tokens came out."""

    def __init__(self):
        self.times: list[float] = []

    def tick(self, *_args) -> None:
        self.times.append(time.perf_counter())


def version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def set_attention(model, name: str) -> None:
    if model.config._attn_implementation == name:
        return
    try:
        model.set_attn_implementation(name)
    except (AttributeError, ValueError, KeyError):
        model.config._attn_implementation = name
    model.config._attn_implementation = name


class System:
    """One way of running the model. Subclasses define `_reply` and, if they cache, `reset`."""

    id = ""
    label = ""
    package = ""                    # the distribution whose version the results name
    attention = "sdpa"              # replaced by the model's own implementation at build time
    clock_on_lm_head = True

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        self.completion = not getattr(tokenizer, "chat_template", None)     # a base model: plain text

    def reset(self) -> None:
        """Forget everything cached: the next sequence starts cold."""

    def answer(self, request: Request, max_new_tokens: int) -> dict:
        set_attention(self.model, self.attention)
        prepared = self._prepare(request)
        clock = TokenClock()
        with self._timing(clock):
            started = time.perf_counter()
            reply = self._reply(prepared, max_new_tokens, clock)
            total = time.perf_counter() - started
        times = clock.times
        n = len(times)
        return {
            "text": reply.text.strip(), "prompt_tokens": reply.prompt_tokens, "reused_tokens": reply.reused_tokens,
            "reused_exact": reply.reused_exact, "reused_moved": reply.reused_moved,
            "hit_rate": reply.reused_tokens / max(1, reply.prompt_tokens),
            "new_tokens": n, "ttft_s": (times[0] - started) if n else total, "total_s": total,
            "decode_tok_s": (n - 1) / (times[-1] - times[0]) if n > 1 and times[-1] > times[0] else None,
        }

    @contextlib.contextmanager
    def _timing(self, clock: TokenClock):
        """Tick `clock` once per generated token while the reply runs: by default on every call of
        the model's lm_head (one per token); systems that time themselves tick in `_reply`."""
        hook = self.model.lm_head.register_forward_hook(clock.tick) if self.clock_on_lm_head else None
        try:
            yield
        finally:
            if hook is not None:
                hook.remove()

    def _prepare(self, request: Request):
        """The caller's own input objects (messages of its framework, or the transcript text in
        completion mode), built before the clock starts."""
        return transcript_text(request.messages) if self.completion else flat_messages(request.messages)

    def _reply(self, prepared, max_new_tokens: int, clock: TokenClock) -> Reply:
        raise NotImplementedError


class Transformers(System):
    id, label, package = "transformers", "transformers `generate`", "transformers"

    def answer_text(self, messages: list[dict], max_new_tokens: int) -> str:
        prompt = transcript_text(messages) if self.completion else messages
        return self._reply(prompt, max_new_tokens, TokenClock()).text.strip()

    def _reply(self, messages, max_new_tokens, clock):
        if isinstance(messages, str):
            inputs = self.tokenizer(messages, return_tensors="pt")
        else:
            inputs = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                        return_dict=True)
        with torch.inference_mode():
            out = self.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        n = inputs["input_ids"].shape[1]
        return Reply(self.tokenizer.decode(out[0, n:], skip_special_tokens=True), n)


class LangChainHuggingFace(System):
    id, label, package = "langchain-huggingface", "langchain-huggingface ChatHuggingFace", "langchain-huggingface"

    def __init__(self, model, tokenizer):
        super().__init__(model, tokenizer)
        from langchain_huggingface import ChatHuggingFace, HuggingFacePipeline
        from transformers import pipeline
        pipe = pipeline("text-generation", model=model, tokenizer=tokenizer, do_sample=False, return_full_text=False)
        self.llm = HuggingFacePipeline(pipeline=pipe)
        self.chat = ChatHuggingFace(llm=self.llm, tokenizer=tokenizer, model_id="SmolLM2-135M-Instruct")

    def _prepare(self, request):
        from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
        if self.completion:
            return transcript_text(request.messages)
        kinds = {"system": SystemMessage, "user": HumanMessage, "assistant": AIMessage}
        return [kinds[m["role"]](m["content"]) for m in flat_messages(request.messages)]

    def _reply(self, messages, max_new_tokens, clock):
        if isinstance(messages, str):
            text = self.llm.invoke(messages, pipeline_kwargs={"max_new_tokens": max_new_tokens})
            return Reply(text, len(self.tokenizer(messages)["input_ids"]))
        reply = self.chat.invoke(messages, pipeline_kwargs={"max_new_tokens": max_new_tokens})
        prompt = self.chat._to_chat_prompt(messages)        # what it sent, for the token count only
        return Reply(reply.content, len(self.tokenizer(prompt, add_special_tokens=False)["input_ids"]))


class LlamaIndexHuggingFace(System):
    id, label, package = "llama-index-llms-huggingface", "llama-index HuggingFaceLLM", "llama-index-llms-huggingface"

    def __init__(self, model, tokenizer):
        super().__init__(model, tokenizer)
        from llama_index.llms.huggingface import HuggingFaceLLM
        self._llms: dict[int, object] = {}
        self._make = lambda n: HuggingFaceLLM(model=model, tokenizer=tokenizer, max_new_tokens=n, device_map="cpu",
                                              generate_kwargs={"do_sample": False}, is_chat_model=not self.completion,
                                              context_window=model.config.max_position_embeddings)
        self._make(8)                                       # fails here, not mid-run, if it cannot work

    def _prepare(self, request):
        from llama_index.core.llms import ChatMessage
        if self.completion:
            return transcript_text(request.messages)
        return [ChatMessage(role=m["role"], content=m["content"]) for m in flat_messages(request.messages)]

    def _reply(self, messages, max_new_tokens, clock):
        llm = self._llms.get(max_new_tokens) or self._llms.setdefault(max_new_tokens, self._make(max_new_tokens))
        if isinstance(messages, str):
            return Reply(llm.complete(messages, formatted=True).text, len(self.tokenizer(messages)["input_ids"]))
        response = llm.chat(messages)
        prompt = llm.messages_to_prompt(messages)            # what it sent, for the token count only
        return Reply(response.message.content, len(self.tokenizer(prompt)["input_ids"]))


class KVBoostPyPI(System):
    """kvboost 0.9.0 from PyPI: its InferenceEngine on our model object, defaults except the
    cache budget (the same 2 GiB as ours), chunk-reuse mode, prompts as chat-template strings."""

    id, label, package = "kvboost-pypi", "kvboost from PyPI", "kvboost"
    clock_on_lm_head = False

    def __init__(self, model, tokenizer):
        super().__init__(model, tokenizer)
        from kvboost import KVBoost
        self.engine = KVBoost(model, tokenizer, max_cache_bytes=2 * GIB)

    def reset(self):
        self.engine.reset_cache()

    def _prepare(self, request):
        if self.completion:
            return transcript_text(request.messages)
        return self.tokenizer.apply_chat_template(flat_messages(request.messages), tokenize=False,
                                                  add_generation_prompt=True)

    def _reply(self, prompt, max_new_tokens, clock):
        r = self.engine.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False, on_token=clock.tick)
        return Reply(r.output_text, r.prompt_tokens, r.cached_tokens)


class OursEngine(System):
    """kvboost_engine.Engine with default options (exact reuse only); documents and files as document parts.

    Tokens are timed from the engine's instruments (its first token, then each decode forward):
    the native decode step does not call the lm_head module."""

    id, label, package = "ours-engine", "ours: Engine", "kvboost-integrations"
    flat = False
    options: dict = {}
    clock_on_lm_head = False

    @contextlib.contextmanager
    def _timing(self, clock: TokenClock):
        from kvboost_engine import FirstTokenEvent, ForwardEvent

        def tick(event):
            if isinstance(event, FirstTokenEvent) or (isinstance(event, ForwardEvent) and event.kind == "decode"):
                clock.tick()
        with self.engine.instruments.subscribe(tick):
            yield

    def __init__(self, model, tokenizer):
        super().__init__(model, tokenizer)
        from kvboost_engine.model.attention import ATTENTION_NAME
        self.attention = ATTENTION_NAME
        self.reset()

    def reset(self):
        from kvboost_engine import Engine
        self.engine = Engine(self.model, self.tokenizer, **self.options)

    def _prepare(self, request):
        return self._prompt(request.messages)

    def _prompt(self, messages):
        """Messages for `engine.chat`; in completion mode transcript segments for `engine.generate`
        (the joined text when flat)."""
        if self.completion:
            return transcript_text(messages) if self.flat else transcript(messages)
        return flat_messages(messages) if self.flat else messages

    def _reply(self, prompt, max_new_tokens, clock):
        if self.completion:
            g = self.engine.generate(prompt, max_new_tokens=max_new_tokens)
        else:
            g = self.engine.chat(prompt, max_new_tokens=max_new_tokens)
        return Reply(g.text, g.prompt_tokens, g.reused_tokens, g.reused_exact, g.reused_moved)


class OursEngineFlat(OursEngine):
    """Our engine given the joined text, as from an unmodified chain (content-defined chunking only)."""

    id, label = "ours-engine-flat", "ours: Engine, documents as one text"
    flat = True


class OursEngineBlend(OursEngine):
    """The opt-in approximate repair of moved documents (blend, 15% recomputed)."""

    id, label = "ours-engine-blend", "ours: Engine, moved reuse opt-in (blend 15%)"
    options = {"moved_reuse": "blend"}


class OursEngineCacheOrder(OursEngine):
    """Exact reuse with cache-aware document order (documents that continue a cached prefix first)."""

    id, label = "ours-engine-cache-order", "ours: Engine, cache-aware document order"

    def __init__(self, model, tokenizer):
        super().__init__(model, tokenizer)
        if self.completion:
            raise RuntimeError("Engine.order_documents orders chat messages: no row for a model without a chat template")

    def _prepare(self, request):
        return request.messages

    def _reply(self, messages, max_new_tokens, clock):
        ordered, _ = self.engine.order_documents(messages)
        return super()._reply(self._prompt(ordered), max_new_tokens, clock)


class OursEngineInt4(OursEngine):
    """Our engine on the same model converted with weights="int4" (its own copy of the weights,
    converted once and cached)."""

    id, label = "ours-engine-int4", 'ours: Engine, weights="int4"'

    def __init__(self, model, tokenizer):
        from kvboost_engine.loading import load_model_and_tokenizer
        source = getattr(model, "bench_source", None)
        if source is None:
            raise RuntimeError("the model has no directory to load its int4 copy from (load it with benchmarks._common)")
        self.int4_model, _ = load_model_and_tokenizer(source, device=torch.device("cpu"), dtype=torch.float32,
                                                      weights="int4")
        super().__init__(model, tokenizer)

    def reset(self):
        from kvboost_engine import Engine
        self.engine = Engine(self.int4_model, self.tokenizer, **self.options)


class OursLangChain(OursEngine):
    id, label = "ours-langchain", "ours: LangChain ChatKVBoost"

    def _prepare(self, request):
        from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

        from kvboost_integrations.langchain import document_block
        if self.completion:                             # KVBoostLLM: a prompt string, no document parts
            return transcript_text(request.messages)
        kinds = {"system": SystemMessage, "user": HumanMessage, "assistant": AIMessage}

        def content(c):
            if isinstance(c, str):
                return c
            return [document_block(p["text"]) if p["type"] == "document" else {"type": "text", "text": p["text"]}
                    for p in c]
        return [kinds[m["role"]](content(m["content"])) for m in request.messages]

    def _reply(self, messages, max_new_tokens, clock):
        from kvboost_integrations.langchain import ChatKVBoost, KVBoostLLM
        if isinstance(messages, str):
            out = KVBoostLLM(engine=self.engine, max_tokens=max_new_tokens).generate([messages]).generations[0][0]
            info = out.generation_info
            return Reply(out.text, info["usage_metadata"]["input_tokens"], info["reused_tokens"],
                         info["reused_exact"], info["reused_moved"])
        reply = ChatKVBoost(engine=self.engine, max_tokens=max_new_tokens).invoke(messages)
        meta = reply.response_metadata
        return Reply(reply.content, reply.usage_metadata["input_tokens"], meta["reused_tokens"],
                     meta["reused_exact"], meta["reused_moved"])


class OursLlamaIndex(OursEngine):
    id, label = "ours-llama-index", "ours: LlamaIndex KVBoost"

    def _prepare(self, request):
        from llama_index.core.llms import ChatMessage

        from kvboost_integrations.llama_index.messages import document_message
        if self.completion:                             # complete(formatted=True): a prompt string
            return transcript_text(request.messages)

        def message(m):
            if isinstance(m["content"], str):
                return ChatMessage(role=m["role"], content=m["content"])
            return document_message(m["role"], [(p["text"], p["type"] == "document") for p in m["content"]])
        return [message(m) for m in request.messages]

    def _reply(self, messages, max_new_tokens, clock):
        from kvboost_integrations.llama_index import KVBoost
        llm = KVBoost(engine=self.engine, max_new_tokens=max_new_tokens)
        if isinstance(messages, str):
            response = llm.complete(messages, formatted=True)
            text = response.text
        else:
            response = llm.chat(messages)
            text = response.message.content
        t = response.raw["kvboost"]
        return Reply(text, t["prompt_tokens"], t["reused_tokens"], t["reused_exact"], t["reused_moved"])


from .llamacpp import LlamaCppLangChain, LlamaCppLlamaIndex  # noqa: E402 - its classes extend System above

SYSTEMS = {cls.id: cls for cls in (Transformers, LangChainHuggingFace, LlamaIndexHuggingFace, KVBoostPyPI,
                                   LlamaCppLangChain, LlamaCppLlamaIndex, OursEngine, OursEngineFlat, OursEngineBlend,
                                   OursEngineCacheOrder, OursEngineInt4, OursLangChain, OursLlamaIndex)}


def build(system_id: str, model, tokenizer, baseline_attention: str) -> System:
    """Build one system; raises with the reason if it cannot run here."""
    system = SYSTEMS[system_id](model, tokenizer)
    if not system.id.startswith("ours"):
        system.attention = baseline_attention
    return system
