"""llama.cpp peers: llama-cpp-python through LangChain `ChatLlamaCpp` and LlamaIndex `LlamaCPP`.

Both run the GGUF file the default model comes from (SmolLM2-135M-Instruct Q4_1, the file our
fp32 model is dequantized from), greedy (temperature 0, top_k 1, repeat_penalty 1), its chat
template, `torch.get_num_threads()` threads for decode and prompt eval, n_batch 512, and
llama-cpp-python's prompt cache on: a `LlamaRAMCache` attached with `set_cache` (neither class
takes a cache argument; LangChain's `cache` field is its own response cache).

Reuse is what llama-cpp-python itself reuses, computed with its own rule before each call: the
longest common token prefix of the prompt with the live context or with the best cache entry
(`Llama.generate` re-evaluates at least the prompt's last token). Token times: one tick per
streamed chunk (one token each).

Settings that matter (measured, /work/notes/llamacpp.md): LangChain's classes pass
rope_freq_base=10000 unless told 0 (= from the GGUF; SmolLM2's is 100000: wrong replies
otherwise); LlamaIndex's default prompt format is not the model's chat template.
llama-cpp-python must be built without AMX in VMs that do not allow it (dev.sh bench does).
"""
from __future__ import annotations

import torch

from .systems import Reply, System
from .workloads import flat_messages

CACHE_BYTES = 2 << 30
N_CTX = 4096
STOP = ["<|im_end|>"]


def gguf_path() -> str:
    from kvboost_engine.loading import default_gguf_file
    return str(default_gguf_file())


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class _LlamaCpp(System):
    """Shared parts: the prompt cache, reuse accounting, streamed token times."""

    clock_on_lm_head = False
    package = "llama-cpp-python"

    def __init__(self, model, tokenizer):
        super().__init__(model, tokenizer)
        if self.completion:
            raise RuntimeError("no completion-mode (base model) path for the llama.cpp rows yet")
        self.threads = torch.get_num_threads()
        self._build()

    def _build(self) -> None:
        raise NotImplementedError

    @property
    def llama(self):
        raise NotImplementedError

    def reset(self):
        from llama_cpp import LlamaRAMCache
        self.llama.reset()                                  # the live context starts empty
        self.llama.set_cache(LlamaRAMCache(capacity_bytes=CACHE_BYTES))

    def _prompt_ids(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.llama.tokenize(text.encode(), add_bos=False, special=True)

    def _reused(self, ids: list[int]) -> int:
        """What llama-cpp-python will not evaluate again for this prompt (its rule, llama.py)."""
        llm, head = self.llama, ids[:-1]
        live = common_prefix(llm._input_ids.tolist(), head)
        cached = 0
        if llm.cache is not None:
            try:
                key = llm.cache._find_longest_prefix_key(tuple(ids))
                cached = common_prefix(key, head) if key is not None else 0
            except (AttributeError, TypeError):
                cached = 0
        return max(live, cached)

    def _reply(self, prepared, max_new_tokens, clock):
        messages, framework_messages = prepared
        ids = self._prompt_ids(messages)
        reused = self._reused(ids)
        parts = []
        for piece in self._stream(framework_messages, max_new_tokens):
            if piece:
                clock.tick()
                parts.append(piece)
        return Reply("".join(parts), len(ids), reused, reused, 0)

    def _stream(self, messages, max_new_tokens):
        raise NotImplementedError


class LlamaCppLangChain(_LlamaCpp):
    id, label = "llamacpp-langchain", "llama.cpp via LangChain ChatLlamaCpp (RAM prompt cache)"

    def _build(self):
        from langchain_community.chat_models import ChatLlamaCpp
        self.chat = ChatLlamaCpp(model_path=gguf_path(), n_ctx=N_CTX, n_batch=512, n_threads=self.threads,
                                 temperature=0.0, top_k=1, top_p=1.0, repeat_penalty=1.0, rope_freq_base=0.0,
                                 seed=0, max_tokens=16, verbose=False,
                                 model_kwargs={"n_threads_batch": self.threads})
        self.reset()

    @property
    def llama(self):
        return self.chat.client

    def _prepare(self, request):
        from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
        kinds = {"system": SystemMessage, "user": HumanMessage, "assistant": AIMessage}
        flat = flat_messages(request.messages)
        return flat, [kinds[m["role"]](m["content"]) for m in flat]

    def _stream(self, messages, max_new_tokens):
        for chunk in self.chat.stream(messages, max_tokens=max_new_tokens):
            yield chunk.content


class LlamaCppLlamaIndex(_LlamaCpp):
    id, label = "llamacpp-llama-index", "llama.cpp via LlamaIndex LlamaCPP (RAM prompt cache)"
    package = "llama-index-llms-llama-cpp"

    def _build(self):
        from llama_index.llms.llama_cpp import LlamaCPP

        def chat_template(messages) -> str:
            turns = [{"role": m.role.value, "content": m.content} for m in messages]
            return self.tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)

        self.llm = LlamaCPP(model_path=gguf_path(), temperature=0.0, max_new_tokens=16, context_window=N_CTX,
                            generate_kwargs={"top_k": 1, "top_p": 1.0, "repeat_penalty": 1.0, "stop": STOP},
                            model_kwargs={"n_threads": self.threads, "n_threads_batch": self.threads,
                                          "n_batch": 512, "seed": 0},
                            messages_to_prompt=chat_template, completion_to_prompt=lambda text: text,
                            verbose=False)
        self.reset()

    @property
    def llama(self):
        return self.llm._model

    def _prepare(self, request):
        from llama_index.core.llms import ChatMessage
        flat = flat_messages(request.messages)
        return flat, [ChatMessage(role=m["role"], content=m["content"]) for m in flat]

    def _stream(self, messages, max_new_tokens):
        self.llm.generate_kwargs["max_tokens"] = max_new_tokens        # per-call kwargs are ignored (measured)
        for response in self.llm.stream_chat(messages):
            yield response.delta
