"""What a request returns: text, tokens and telemetry; and the stream that produces it."""
from __future__ import annotations

import threading
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field


class RequestCounters:
    """Totals over an engine's requests, however each ended (Engine.stats()): requests, prompt,
    reused and generated tokens. Thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self._totals = dict.fromkeys(("requests", "prompt_tokens", "reused_tokens", "generated_tokens"), 0)

    def count(self, gen: "Generation") -> None:
        with self._lock:
            t = self._totals
            t["requests"] += 1
            t["prompt_tokens"] += gen.prompt_tokens
            t["reused_tokens"] += gen.reused_tokens
            t["generated_tokens"] += gen.completion_tokens

    def snapshot(self) -> dict:
        with self._lock:
            return dict(self._totals)


@dataclass(slots=True)
class Generation:
    """Result of one request.

    prompt_tokens: tokens in the prompt. reused_tokens: prompt tokens whose KV came from the
    cache = reused_exact (exact-prefix hits: identical to no cache) + reused_moved (moved hits,
    re-rotated and repaired: an approximation). recomputed: moved tokens that the repair
    recomputed through every layer anyway. computed_tokens: prompt tokens run through every
    layer this call (new ones plus recomputed).
    ttft_s: from the call until the first generated token exists. token_ids: generated ids
    (an EOS that ended generation included; it is not part of `text`).
    finish_reason: "stop" (EOS, stop string or a finished constraint), "length" (max_new_tokens),
    "cancelled", or "error" (the request raised; seen only by instrumentation and stats).
    logprobs: with `logprobs=True`, one entry per generated token but the ending EOS (OpenAI's
    chat `logprobs.content` items: token, token_id, logprob, bytes, top_logprobs); else None.
    """

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    prompt_tokens: int = 0
    reused_tokens: int = 0
    reused_exact: int = 0
    reused_moved: int = 0
    recomputed: int = 0
    ttft_s: float = 0.0
    total_s: float = 0.0
    logprobs: list[dict] | None = None

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.reused_tokens + self.recomputed

    def usage(self) -> dict:
        return {"input_tokens": self.prompt_tokens, "output_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def telemetry(self) -> dict:
        data = {name: getattr(self, name) for name in _TELEMETRY}
        data["completion_tokens"] = self.completion_tokens
        data["computed_tokens"] = self.computed_tokens
        return data


_TELEMETRY = ("finish_reason", "prompt_tokens", "reused_tokens", "reused_exact", "reused_moved", "recomputed",
              "ttft_s", "total_s")


class GenerationStream(Iterator[str]):
    """Iterates text deltas. After the last one, `.generation` holds the full result.

    `cancel()` (from any thread) stops decoding before the next token; `close()` does the same
    from the consuming side and returns once the request has ended. Either way the KV computed so
    far is stored consistently. A stream its caller leaves unfinished is cancelled too: when an
    error or an interrupt (Ctrl-C, a timeout) reaches the caller through it, and when it is
    garbage-collected (a loop that breaks out and drops it) - the request does not decode on to
    max_new_tokens for no one.
    """

    def __init__(self, run: Generator[str, None, Generation], cancel_event: threading.Event):
        self._run = run
        self._cancel = cancel_event
        self.generation: Generation | None = None

    def __next__(self) -> str:
        try:
            return next(self._run)
        except StopIteration as done:
            self.generation = done.value
            raise
        except BaseException:
            self._cancel.set()              # the caller stops waiting (timeout, interrupt, error): the request stops
            raise

    def __del__(self) -> None:
        if self.generation is None:
            self._cancel.set()              # dropped unfinished: nobody reads the rest

    def cancel(self) -> None:
        self._cancel.set()

    def close(self) -> None:
        """Stop the request and wait until it has ended (its KV stored, its blocks freed)."""
        self._cancel.set()
        if self.generation is not None:
            return
        try:
            while True:
                next(self._run)
        except StopIteration as done:
            self.generation = done.value
        except Exception:  # noqa: BLE001 - the caller left; a late error has no one to go to
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def collect(self) -> Generation:
        """Run to the end and return the Generation."""
        for _ in self:
            pass
        assert self.generation is not None
        return self.generation
