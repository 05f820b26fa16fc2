"""Cache-aware document order: documents whose KV is cached right after the prompt so far go first.

RAG prompts often bring back documents that earlier prompts had already put in some order after
the same system prompt. Placing first the documents that continue a cached sequence (a prefix tree
over document sequences, as RAGCache does) turns them into exact-prefix hits: the same tokens as
no cache, no approximation. Documents that continue nothing cached keep their relevance order.
The same holds for a plain prompt of segments (`Engine.generate`): runs of "document" segments.
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
        for first, last in _document_runs(content, _is_document_part):
            run, count = _order_run(out[:index], message, content[:first], content[first:last], encode, cached_prefix)
            content = content[:first] + run + content[last:]
            placed += count
        out[index] = {**message, "content": content}
    return out, placed


def order_segments(segments: list, encode: Callable[[list], TokenizedPrompt],
                   cached_prefix: Callable[[list[int], int], int]) -> tuple[list, int]:
    """A plain prompt's segments with each run of "document" segments reordered as
    `order_documents` does; and how many documents were placed from the cache.

    `encode(segments)` tokenizes a segment list as a prompt; `cached_prefix` as above.
    """
    out, placed = list(segments), 0
    for first, last in _document_runs(out, lambda seg: getattr(seg, "kind", None) == "document"):
        run, count = _greedy(out[first:last],
                             lambda trial, head=out[:first]: _continues_cache(head + trial, encode, cached_prefix))
        out[first:last] = run
        placed += count
    return out, placed


def _is_document_part(part) -> bool:
    return isinstance(part, dict) and part.get("type") == "document"


def _document_runs(parts: list, is_document: Callable[[object], bool]) -> list[tuple[int, int]]:
    """[first, last) of each run of consecutive items that are documents."""
    runs, start = [], None
    for i, part in enumerate(parts + [None]):
        is_doc = part is not None and is_document(part)
        if is_doc and start is None:
            start = i
        elif not is_doc and start is not None:
            runs.append((start, i))
            start = None
    return runs


def _order_run(before: list[dict], message: dict, head: list, documents: list, encode, cached_prefix):
    return _greedy(documents, lambda trial: _continues_cache(before + [{**message, "content": head + trial}],
                                                             encode, cached_prefix))


def _greedy(documents: list, continues: Callable[[list], bool]) -> tuple[list, int]:
    """Documents that continue the cache first (each after those chosen before it), the rest in order."""
    chosen, remaining = [], list(documents)
    while remaining:
        # an empty document adds no chunk: it would "continue" whatever the one before it does
        hit = next((d for d in remaining if _text_of(d) != "" and continues(chosen + [d])), None)
        if hit is None:
            break
        chosen.append(hit)
        remaining.remove(hit)
    return chosen + remaining, len(chosen)


def _text_of(document) -> str | None:
    """A document part's or segment's text (None where it has none to read)."""
    if isinstance(document, str):
        return document
    text = document.get("text") if isinstance(document, dict) else getattr(document, "text", None)
    return text if isinstance(text, str) else None


def _continues_cache(trial: list[dict], encode, cached_prefix) -> bool:
    prompt = encode(trial)
    if "document" not in prompt.chunk_kinds:
        return False                    # the template rewrote the content: no document edges to use
    last = len(prompt.chunk_kinds) - 1 - prompt.chunk_kinds[::-1].index("document")
    end = prompt.chunk_ends[last]
    return cached_prefix(prompt.token_ids, end) >= end
