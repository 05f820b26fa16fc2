"""A request's logprobs as a framework hands them out while it streams.

Deltas carry the entries of their tokens (`kvboost_engine.TextDelta.logprobs`); a framework chunk
takes those seen so far (a delta whose text is held back, a tool call's start, passes its entries
on to the next chunk), and the final chunk takes the rest from the Generation, so the chunks
together carry every entry once, in order.
"""
from __future__ import annotations


class LogprobTrail:
    """Entries seen in deltas and not yet handed out, and how many were handed out."""

    def __init__(self):
        self._pending: list[dict] = []
        self.sent = 0

    def feed(self, delta) -> None:
        """Note the entries a delta carries (none for a plain str delta)."""
        entries = getattr(delta, "logprobs", None)
        if entries:
            self._pending.extend(entries)

    def take(self) -> list[dict]:
        """The entries not yet handed out, for the chunk going out now."""
        out, self._pending = self._pending, []
        self.sent += len(out)
        return out

    def rest(self, gen) -> list[dict] | None:
        """For the final chunk: every entry of `gen` not handed out yet; None when none were recorded."""
        if getattr(gen, "logprobs", None) is None:
            return None
        out = gen.logprobs[self.sent:]
        self._pending, self.sent = [], len(gen.logprobs)
        return out
