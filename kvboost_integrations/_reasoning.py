"""Reasoning models, framework-neutral: the chat template's thinking switch, and a reply's thinking
separated from its answer as the text streams.

Qwen3 writes `<think>\\n...\\n</think>\\n\\n` before its answer; its template turns that off with
`enable_thinking=False` (it then writes an empty think block into the prompt), and drops the
thinking of earlier turns from the history (it keeps it only after the last user query, where a
tool loop goes on). Other templates open the think block in the prompt themselves (DeepSeek-R1):
the reply then starts inside it. Both are handled here; the template decides what the model sees.
"""
from __future__ import annotations

from kvboost_engine import InputError

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
SWITCH = "enable_thinking"


def thinking_kwargs(tokenizer, reasoning: bool | None, *, remote: bool = False, name: str = "reasoning") -> dict:
    """Chat-template kwargs for `reasoning` (None: the template's default, nothing passed). Over an
    endpoint the switch goes to the server's template. InputError when the template cannot honour it,
    naming the caller's parameter (`name`: LangChain's reasoning, LlamaIndex's thinking)."""
    if reasoning is None:
        return {}
    if not isinstance(reasoning, bool):
        raise InputError(f"{name} must be True, False or None, got {reasoning!r}")
    template = _template(tokenizer)
    if remote or SWITCH in template:
        return {SWITCH: reasoning}
    if reasoning and THINK_OPEN in template:        # always thinks (the prompt opens the block): separate only
        return {}
    if THINK_OPEN in template and opens_thinking(tokenizer, {}):
        raise InputError(f"{name}=False: this model's chat template opens a think block in every reply and has "
                         f"no switch ({SWITCH}): its thinking cannot be turned off (None keeps it in the text)")
    raise InputError(f"{name}={reasoning} needs a model whose chat template has a thinking switch "
                     f"({SWITCH}, as Qwen3's) or thinks always; this model's template has neither")


def opens_thinking(tokenizer, template_kwargs: dict) -> bool:
    """Whether the template's generation prompt leaves a think block open (the reply starts inside it)."""
    if THINK_OPEN not in _template(tokenizer):
        return False
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "?"}], tokenize=False,
                                           add_generation_prompt=True, **template_kwargs)
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


def _template(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    return template if isinstance(template, str) else str(template)


class ThinkingSplitter:
    """Streamed reply text -> (thinking, answer) deltas. The think tags and the newlines around the
    thinking are dropped; text that could still be a tag is held back until it is known."""

    def __init__(self, inside: bool = False):
        self._state = "inside" if inside else "start"      # start -> inside -> after -> answer
        self._held = ""
        self._fresh = True                                  # no thinking text yet (skip its first newlines)

    def feed(self, text: str) -> tuple[str, str]:
        self._held += text
        thought, answer = [], []
        while self._step(thought, answer):
            pass
        return "".join(thought), "".join(answer)

    def finish(self) -> tuple[str, str]:
        """What is held at the end: thinking cut short, or the answer's last characters."""
        held, self._held = self._held, ""
        if self._state == "inside":
            return (held.lstrip("\n") if self._fresh else held), ""
        return ("", "") if self._state == "after" else ("", held)

    def _step(self, thought: list[str], answer: list[str]) -> bool:
        """Move through the held text; False when it must wait for more."""
        held = self._held
        if self._state == "start":
            stripped = held.lstrip()
            if stripped.startswith(THINK_OPEN):
                self._held, self._state = stripped[len(THINK_OPEN):], "inside"
                return True
            if THINK_OPEN.startswith(stripped):
                return False                                # may still open a block
            self._state = "answer"
            return True
        if self._state == "inside":
            return self._inside(thought)
        if self._state == "after":
            self._held = held.lstrip("\n")
            if not self._held:
                return False
            self._state = "answer"
            return True
        answer.append(held)
        self._held = ""
        return False

    def _inside(self, thought: list[str]) -> bool:
        held = self._held.lstrip("\n") if self._fresh else self._held
        at = held.find(THINK_CLOSE)
        if at >= 0:
            thought.append(held[:at].rstrip("\n"))
            self._held, self._state = held[at + len(THINK_CLOSE):], "after"
            return True
        keep = next((size for size in range(min(len(THINK_CLOSE) - 1, len(held)), 0, -1)
                     if held.endswith(THINK_CLOSE[:size])), 0)
        end = len(held) - keep
        while end > 0 and held[end - 1] == "\n":            # newlines just before </think> are not thinking
            end -= 1
        if end:
            thought.append(held[:end])
            self._fresh = False
        self._held = held[end:]
        return False
