"""Who runs in one batch step: every decoding request (one token each), then chunks of the prompts
being prefilled, within the step's token budget."""
from __future__ import annotations

from .decode import Decoding, Request
from .prefill import Assembled


class Prefilling:
    """A request whose prompt is computed chunk by chunk in batch steps."""

    __slots__ = ("request", "assembled", "cursor")

    def __init__(self, request: Request, assembled: Assembled):
        self.request, self.assembled, self.cursor = request, assembled, assembled.start


def plan_step(decoding: list[Decoding], prefilling: list[Prefilling], max_batch_tokens: int,
              chunk_tokens: int) -> tuple[list, list, list]:
    """(owners, forward items (kv, token ids, start), want logits) of the next step."""
    owners, items, want = [], [], []
    for request in decoding:
        owners.append(request)
        items.append(request.next_input())
        want.append(True)
    budget = max_batch_tokens - len(items)
    # Shortest remaining prompt first: a short request arriving during a long prefill rides the
    # next chunk's forward (its TTFT is one chunk, not the whole long prompt).
    for pre in sorted(prefilling, key=lambda p: len(p.request.prompt) - p.cursor):
        if budget <= 0:
            break
        n = len(pre.request.prompt)
        take = min(budget, chunk_tokens, n - pre.cursor)
        owners.append(pre)
        items.append((pre.assembled.sequence, pre.request.prompt.token_ids[pre.cursor:pre.cursor + take], pre.cursor))
        want.append(pre.cursor + take == n)
        budget -= take
    return owners, items, want
