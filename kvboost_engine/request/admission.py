"""Admission checks of the scheduler: does a request fit the KV pool at all, and should it wait
for a prompt being prefilled that it continues."""
from __future__ import annotations

from ..errors import BudgetError
from ..kv.tree import common_prefix
from .decode import Request
from .prefill import PrefillParts


def check_fits_alone(parts: PrefillParts, request: Request) -> None:
    """BudgetError (before any work) if the request's KV cannot fit the pool even with nothing else running."""
    if not parts.config.paged:
        return                                  # contiguous requests bring their own buffers
    pool, cache = parts.cache.pool, parts.cache
    need = -(-(len(request.prompt) + request.params.max_new_tokens) // pool.block_tokens)
    room = pool.total_blocks - cache.budget.pinned_bytes // pool.block_bytes
    if need > room:
        raise BudgetError(f"request refused before any work: it needs KV for "
                          f"{len(request.prompt) + request.params.max_new_tokens} positions ({need} blocks of "
                          f"{pool.block_tokens} tokens) but the KV pool holds {room} blocks next to pinned "
                          f"chunks ({pool.total_blocks * pool.block_bytes} bytes in all)")


def continues_a_prefill(parts: PrefillParts, request: Request, prefilling: list[Request]) -> bool:
    """Whether a prompt still being prefilled covers more of this one than the cache does
    (then this one waits for it to be stored and maps its blocks instead of computing them)."""
    if not prefilling:
        return False
    tokens = request.prompt.token_ids
    shared = max(common_prefix(tuple(p.prompt.token_ids), tokens, 0) for p in prefilling)
    cached = parts.cache.cached_prefix(tokens, len(tokens) - 1)
    return shared > cached + parts.cache.block_tokens
