"""LlamaIndex integration: the `KVBoost` LLM and a node-aligned response synthesizer.

Install with the extra: `pip install "kvboost-integrations[llama-index]"`.
"""
try:
    import llama_index.core  # noqa: F401
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError(
        "kvboost_integrations.llama_index needs llama-index-core: "
        'pip install "kvboost-integrations[llama-index]"'
    ) from err

from .llm import KVBoost
from .messages import DOCUMENT_BLOCKS, ModelTokenizer, document_message, to_engine_messages
from .query import as_query_engine, prompt_helper
from .synthesizer import KVBoostSynthesizer
from .telemetry import ReuseRecorder
from .warming import WarmNodes

__all__ = ["KVBoost", "KVBoostSynthesizer", "WarmNodes", "as_query_engine", "prompt_helper", "ReuseRecorder", "ModelTokenizer",
           "DOCUMENT_BLOCKS", "document_message", "to_engine_messages"]
