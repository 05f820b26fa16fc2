"""`KVBoostSynthesizer`: response synthesis that hands every retrieved node to the model as its
own document part, so the cache sees where each node begins and reuses its KV.

The stock `compact` mode joins the nodes into one string and re-splits it, so node edges are
lost. Here a call's context is a list of whole nodes. Modes:

- "compact": as many whole nodes per call as fit; further calls refine the answer.
- "refine": one node per call, each refining the answer so far.
- "tree_summarize": whole-node groups are answered, then the answers are combined.

The planning of calls is written once (`_plan`); the sync and async drivers only run them.
"""
from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from llama_index.core.base.response.schema import RESPONSE_TYPE
from llama_index.core.prompts import BasePromptTemplate
from llama_index.core.prompts.default_prompt_selectors import (
    DEFAULT_REFINE_PROMPT_SEL,
    DEFAULT_TEXT_QA_PROMPT_SEL,
    DEFAULT_TREE_SUMMARIZE_PROMPT_SEL,
)
from llama_index.core.response_synthesizers.base import BaseSynthesizer, QueryTextType
from llama_index.core.schema import MetadataMode, NodeWithScore

from .llm import KVBoost
from .packing import fit_texts, pack, template_messages
from .telemetry import SynthesisTelemetry

MODES = ("compact", "refine", "tree_summarize")
NODE_ORDERS = ("retrieved", "source", "cache")


@dataclass
class _Step:
    """One LLM call: a template, the texts that fill its context variable, other variables."""

    template: BasePromptTemplate
    context_var: str
    texts: list[str]
    kwargs: dict = field(default_factory=dict)
    final: bool = False             # its answer is the response (streamed when streaming)


class KVBoostSynthesizer(BaseSynthesizer):
    """A response synthesizer that passes each retrieved node as its own document part.

    Use it as `index.as_query_engine(llm=llm, response_synthesizer=KVBoostSynthesizer(llm))`
    or through `as_query_engine(index, llm)`. `response.metadata["kvboost"]` holds the reuse
    telemetry of all LLM calls (filled when a streamed response ends).

    node_order: "retrieved" (as the retriever ranked them), "source" (by document and
        position: the same nodes then always give the same prompt, reused exactly), or "cache"
        (nodes that continue a cached prefix first, the rest as retrieved: see
        Engine.order_documents; `metadata["kvboost"]["documents_from_cache"]` counts them).
    """

    def __init__(self, llm: Optional[KVBoost] = None, response_mode: str = "compact", *,
                 streaming: bool = False, node_order: str = "retrieved",
                 text_qa_template: Optional[BasePromptTemplate] = None,
                 refine_template: Optional[BasePromptTemplate] = None,
                 summary_template: Optional[BasePromptTemplate] = None,
                 padding_tokens: int = 5, **kwargs: Any):
        mode = getattr(response_mode, "value", response_mode)
        if mode not in MODES:
            raise ValueError(f"response_mode must be one of {', '.join(MODES)}, got {response_mode!r}")
        if node_order not in NODE_ORDERS:
            raise ValueError(f"node_order must be one of {', '.join(NODE_ORDERS)}, got {node_order!r}")
        super().__init__(llm=llm, streaming=streaming, **kwargs)
        self._mode = mode
        self._node_order = node_order
        self._text_qa_template = text_qa_template or DEFAULT_TEXT_QA_PROMPT_SEL
        self._refine_template = refine_template or DEFAULT_REFINE_PROMPT_SEL
        self._summary_template = summary_template or DEFAULT_TREE_SUMMARIZE_PROMPT_SEL
        self._padding_tokens = padding_tokens

    def _get_prompts(self) -> dict:
        return {"text_qa_template": self._text_qa_template, "refine_template": self._refine_template,
                "summary_template": self._summary_template}

    def _update_prompts(self, prompts: dict) -> None:
        for name in ("text_qa_template", "refine_template", "summary_template"):
            if name in prompts:
                setattr(self, f"_{name}", prompts[name])

    # ---- entry points ---------------------------------------------------------------------
    def synthesize(self, query: QueryTextType, nodes: list[NodeWithScore],
                   additional_source_nodes: Optional[Sequence[NodeWithScore]] = None, **kwargs: Any) -> RESPONSE_TYPE:
        telemetry = SynthesisTelemetry()
        response = super().synthesize(query, self._ordered(nodes), additional_source_nodes,
                                      kvboost_telemetry=telemetry, **kwargs)
        return self._finish(response, nodes, additional_source_nodes, telemetry)

    async def asynthesize(self, query: QueryTextType, nodes: list[NodeWithScore],
                          additional_source_nodes: Optional[Sequence[NodeWithScore]] = None,
                          **kwargs: Any) -> RESPONSE_TYPE:
        telemetry = SynthesisTelemetry()
        response = await super().asynthesize(query, self._ordered(nodes), additional_source_nodes,
                                             kvboost_telemetry=telemetry, **kwargs)
        return self._finish(response, nodes, additional_source_nodes, telemetry)

    def get_response(self, query_str: str, text_chunks: Sequence[str], prev_response: Optional[str] = None,
                     kvboost_telemetry: Optional[SynthesisTelemetry] = None, **kwargs: Any):
        """The answer for `query_str` from `text_chunks` (one per node): a str, or a token
        generator when streaming."""
        plan = self._plan(query_str, list(text_chunks), prev_response)
        return self._drive(plan, kvboost_telemetry or SynthesisTelemetry(), kwargs)

    async def aget_response(self, query_str: str, text_chunks: Sequence[str], prev_response: Optional[str] = None,
                            kvboost_telemetry: Optional[SynthesisTelemetry] = None, **kwargs: Any):
        """Async `get_response`; when streaming, an async token generator."""
        plan = self._plan(query_str, list(text_chunks), prev_response)
        return await self._adrive(plan, kvboost_telemetry or SynthesisTelemetry(), kwargs)

    def _ordered(self, nodes: list[NodeWithScore]) -> list[NodeWithScore]:
        if self._node_order in ("retrieved", "cache"):             # "cache" reorders per call, in the LLM
            return list(nodes)
        return sorted(nodes, key=lambda n: (n.node.ref_doc_id or "", n.node.start_char_idx or 0, n.node.node_id))

    def _finish(self, response, nodes, additional_source_nodes, telemetry: SynthesisTelemetry):
        """Source nodes in retrieval order (the prompt may have had another); telemetry in metadata."""
        if nodes:
            response.source_nodes = list(nodes) + list(additional_source_nodes or [])
            response.metadata = {**(response.metadata or {}), "kvboost": telemetry.data}
        return response

    # ---- planning (written once) ------------------------------------------------------------
    def _plan(self, query_str: str, texts: list[str], answer: Optional[str]) -> Generator[_Step, str, None]:
        """Yields the calls to make; each yield receives that call's answer."""
        if self._mode == "tree_summarize":
            yield from self._plan_tree(query_str, texts)
            return
        qa = (self._text_qa_template, "context_str")
        refine = (self._refine_template, "context_msg")
        budget = min(self._budget(*qa, query_str=query_str),
                     self._budget(*refine, query_str=query_str, existing_answer="") - self._num_output())
        texts = fit_texts(texts, self._tokenizer(), budget)
        groups = pack(texts, self._tokenizer(), budget) if self._mode == "compact" else [[t] for t in texts]
        for index, group in enumerate(groups):
            final = index == len(groups) - 1
            if answer is None:
                answer = yield _Step(*qa, group, {"query_str": query_str}, final)
            else:
                answer = yield _Step(*refine, group, {"query_str": query_str, "existing_answer": answer}, final)

    def _plan_tree(self, query_str: str, texts: list[str]) -> Generator[_Step, str, None]:
        summary = (self._summary_template, "context_str")
        budget = self._budget(*summary, query_str=query_str)
        texts = fit_texts(texts, self._tokenizer(), budget)
        while True:
            groups = pack(texts, self._tokenizer(), budget)
            if len(groups) == 1:
                yield _Step(*summary, groups[0], {"query_str": query_str}, final=True)
                return
            answers = []
            for group in groups:
                answers.append((yield _Step(*summary, group, {"query_str": query_str})))
            texts = answers

    def _budget(self, template: BasePromptTemplate, context_var: str, **kwargs) -> int:
        """Tokens left for context in one call of `template`."""
        messages = self._messages(_Step(template, context_var, [], kwargs))
        if isinstance(self._llm, KVBoost):
            overhead = self._llm.count_prompt_tokens(messages)
        else:
            overhead = sum(len(self._tokenizer()(m.content or "")) + 4 for m in messages)
        window = self._llm.metadata.context_window
        return window - self._num_output() - overhead - self._padding_tokens

    def _num_output(self) -> int:
        return self._llm.metadata.num_output

    def _tokenizer(self):
        if isinstance(self._llm, KVBoost):
            return self._llm.tokenizer
        return self._prompt_helper._token_counter.tokenizer

    def _messages(self, step: _Step):
        messages = template_messages(step.template, self._llm, step.context_var, step.texts,
                                     mark_documents=isinstance(self._llm, KVBoost), **step.kwargs)
        return self._llm._extend_messages(messages)

    def _call_kwargs(self, kwargs: dict) -> dict:
        if self._node_order == "cache" and isinstance(self._llm, KVBoost):
            return {**kwargs, "document_order": "cache"}
        return kwargs

    def warm(self, nodes, query_str: str = "") -> int:
        """Cache each node where this synthesizer's question-answering prompt puts a first node (the
        layout up to the node is the same whatever the question), so later calls whose first node it
        is reuse it exactly (with node_order="cache", any warmed node can go first). A node is cached as
        synthesis sends it: with its metadata header (MetadataMode.LLM). Returns tokens cached."""
        if not isinstance(self._llm, KVBoost):
            raise TypeError("warm() needs the KVBoost LLM")
        total = 0
        for node in nodes:
            node = node.node if isinstance(node, NodeWithScore) else node
            # as synthesis sends it: the metadata header (file_name, ... from any loader) and the text
            text = node.get_content(metadata_mode=MetadataMode.LLM) if hasattr(node, "get_content") else node
            step = _Step(self._text_qa_template, "context_str", [text], {"query_str": query_str})
            total += self._llm.engine.warm(self._llm.chat_prompt(self._messages(step)))     # as chat() sends it
        return total

    # ---- drivers ------------------------------------------------------------------------------
    def _drive(self, plan: Generator[_Step, str, None], telemetry: SynthesisTelemetry, kwargs: dict):
        step = next(plan)
        while True:
            if step.final and self._streaming:
                return telemetry.tokens(self._llm.stream_chat(self._messages(step), **self._call_kwargs(kwargs)))
            response = self._llm.chat(self._messages(step), **self._call_kwargs(kwargs))
            telemetry.add(response.raw)
            answer = response.message.content or ""
            if step.final:
                return answer or self._empty_response
            step = plan.send(answer)

    async def _adrive(self, plan: Generator[_Step, str, None], telemetry: SynthesisTelemetry, kwargs: dict):
        step = next(plan)
        while True:
            if step.final and self._streaming:
                return telemetry.atokens(await self._llm.astream_chat(self._messages(step), **self._call_kwargs(kwargs)))
            response = await self._llm.achat(self._messages(step), **self._call_kwargs(kwargs))
            telemetry.add(response.raw)
            answer = response.message.content or ""
            if step.final:
                return answer or self._empty_response
            step = plan.send(answer)
