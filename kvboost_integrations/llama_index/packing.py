"""Prompt templates with nodes as document parts, and packing whole nodes into calls.

A template is formatted with a sentinel in place of its context variable; the message that
holds the sentinel is split there, and every node text goes in as its own document part.
Nodes are never re-packed into one string: a group of nodes is a list of whole node texts,
and only a node longer than a whole call is cut (deterministically, so it caches the same
way next time).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.node_parser import TokenTextSplitter
from llama_index.core.prompts import BasePromptTemplate

from .messages import document_message

# Private-use code points: no template text contains them.
_SENTINEL = "\ue010kvboost-context\ue011"
# Document parts are joined by a separator; allow this many tokens of it per node.
SEPARATOR_TOKENS = 2


def template_messages(template: BasePromptTemplate, llm, context_var: str, texts: Sequence[str],
                      *, mark_documents: bool, **kwargs) -> list[ChatMessage]:
    """`template` as chat messages with `texts` in place of `{context_var}`, one part each.

    With `mark_documents` the texts are document parts (KVBoost caches them by content);
    otherwise the message is plain text joined as LlamaIndex would join it.
    """
    messages = template.format_messages(llm=llm, **{context_var: _SENTINEL}, **kwargs)
    out: list[ChatMessage] = []
    found = False
    for message in messages:
        content = message.content or ""
        if _SENTINEL not in content:
            out.append(message)
            continue
        if found or content.count(_SENTINEL) > 1:
            raise ValueError(f"the prompt template uses {{{context_var}}} more than once")
        found = True
        before, after = content.split(_SENTINEL)
        parts = [(before.rstrip("\n"), False)] if before.strip() else []
        parts += [(text, True) for text in texts]
        parts += [(after.lstrip("\n"), False)] if after.strip() else []
        if mark_documents:
            out.append(document_message(message.role, parts))
        else:
            out.append(ChatMessage(role=message.role, content="\n\n".join(text for text, _ in parts)))
    if not found:
        raise ValueError(f"the prompt template has no {{{context_var}}} variable for the retrieved nodes")
    return out


def fit_texts(texts: Sequence[str], tokenizer: Callable[[str], list], budget: int) -> list[str]:
    """`texts` in order; any longer than `budget` tokens is cut into pieces that fit."""
    if budget <= SEPARATOR_TOKENS:
        raise ValueError(f"the prompt leaves only {budget} tokens for context; raise the context window "
                         "or lower max_new_tokens")
    limit = budget - SEPARATOR_TOKENS
    out: list[str] = []
    for text in texts:
        if len(tokenizer(text)) <= limit:
            out.append(text)
        else:
            splitter = TokenTextSplitter(chunk_size=limit, chunk_overlap=0, tokenizer=tokenizer, separator=" ")
            out.extend(splitter.split_text(text))
    return out


def pack(texts: Sequence[str], tokenizer: Callable[[str], list], budget: int) -> list[list[str]]:
    """Groups of consecutive whole texts, each group within `budget` tokens (texts must fit alone)."""
    groups: list[list[str]] = []
    used = budget + 1
    for text in texts:
        size = len(tokenizer(text)) + SEPARATOR_TOKENS
        if used + size > budget:
            groups.append([])
            used = 0
        groups[-1].append(text)
        used += size
    return groups
