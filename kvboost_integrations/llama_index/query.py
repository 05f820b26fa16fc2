"""Helpers that wire KVBoost into existing LlamaIndex indexes."""
from __future__ import annotations

from typing import Any, Optional

from llama_index.core.indices.prompt_helper import PromptHelper

from .llm import KVBoost
from .synthesizer import KVBoostSynthesizer


def as_query_engine(index, llm: Optional[KVBoost] = None, *, response_mode: str = "compact",
                    streaming: bool = False, node_order: str = "retrieved", **kwargs: Any):
    """`index.as_query_engine(...)` answering with `llm` through the node-aligned synthesizer.

    Other keyword arguments (`similarity_top_k`, `node_postprocessors`, ...) go to
    `index.as_query_engine` unchanged.
    """
    llm = llm or KVBoost()
    synthesizer = KVBoostSynthesizer(llm, response_mode, streaming=streaming, node_order=node_order)
    return index.as_query_engine(llm=llm, response_synthesizer=synthesizer, **kwargs)


def prompt_helper(llm: KVBoost, **kwargs: Any) -> PromptHelper:
    """A PromptHelper that budgets with the model's context window, output size and tokenizer
    (for the stock synthesizers: `get_response_synthesizer(llm=llm, prompt_helper=...)`)."""
    return PromptHelper.from_llm_metadata(llm.metadata, tokenizer=llm.tokenizer, **kwargs)
