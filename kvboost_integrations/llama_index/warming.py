"""Warming nodes at ingestion: each node's KV computed once where the synthesizer will put it first."""
from __future__ import annotations

from typing import Any

from llama_index.core.bridge.pydantic import ConfigDict, Field
from llama_index.core.schema import BaseNode, TransformComponent


class WarmNodes(TransformComponent):
    """An ingestion transformation (last in `IngestionPipeline(transformations=[...])` or
    `VectorStoreIndex.from_documents(..., transformations=[...])`) that caches each node where
    `synthesizer` (a KVBoostSynthesizer) puts a first node, and passes the nodes on unchanged.
    A question whose first node is warmed reuses it exactly; with node_order="cache" any warmed
    node goes first."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    synthesizer: Any = Field(description="The KVBoostSynthesizer whose prompts will use the nodes.")

    def __call__(self, nodes: list[BaseNode], **kwargs: Any) -> list[BaseNode]:
        self.synthesizer.warm(nodes)
        return nodes
