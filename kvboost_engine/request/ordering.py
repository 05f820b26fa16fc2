"""Cache-aware document order: documents whose KV is cached right after the prompt so far go first.

RAG prompts often bring back documents that earlier prompts had already put in some order after
the same system prompt. Placing first the documents that continue a cached sequence (a prefix tree
over document sequences, as RAGCache does) turns them into exact-prefix hits: the same tokens as
no cache, no approximation. Documents that continue nothing cached keep their relevance order.
"""
from __future__ import annotations

from collections.abc import Callable

from .tokens import TokenizedPrompt


def order_documents(messages: list[dict], encode: Callable[[list[dict]], TokenizedPrompt],
                    cached_prefix: Callable[[list[int], int], int]) -> tuple[list[dict], int]:
    """`messages` with the document parts of each message reordered; and how many documents were
    placed because their KV continues a cached prefix.

    `encode(messages)` tokenizes messages as a prefix (no generation prompt); `cached_prefix(ids,
    limit)` says how many of ids[:limit] are cached as an exact prefix.
    """
    out, placed = [dict(m) for m in messages], 0
    for index, message in enumerate(out):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for first, last in _document_runs(content):
            run, count = _order_run(out[:index], message, content[:first], content[first:last], encode, cached_prefix)
            content = content[:first] + run + content[last:]
            placed += count
        out[index] = {**message, "content": content}
    return out, placed


def _document_runs(parts: list) -> list[tuple[int, int]]:
    """[first, last) of each run of consecutive document parts."""
    runs, start = [], None
    for i, part in enumerate(parts + [None]):
        is_doc = isinstance(part, dict) and part.get("type") == "document"
        if is_doc and start is None:
            start = i
        elif not is_doc and start is not None:
            runs.append((start, i))
            start = None
    return runs


def _order_run(before: list[dict], message: dict, head: list, documents: list, encode, cached_prefix):
    chosen, remaining = [], list(documents)
    while remaining:
        hit = next((d for d in remaining
                    if _continues_cache(before + [{**message, "content": head + chosen + [d]}], encode, cached_prefix)),
                   None)
        if hit is None:
            break
        chosen.append(hit)
        remaining.remove(hit)
    return chosen + remaining, len(chosen)


def _continues_cache(trial: list[dict], encode, cached_prefix) -> bool:
    prompt = encode(trial)
    if "document" not in prompt.chunk_kinds:
        return False                    # the template rewrote the content: no document edges to use
    last = len(prompt.chunk_kinds) - 1 - prompt.chunk_kinds[::-1].index("document")
    end = prompt.chunk_ends[last]
    return cached_prefix(prompt.token_ids, end) >= end
