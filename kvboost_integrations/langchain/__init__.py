"""LangChain integration: ChatKVBoost and KVBoostLLM, plus RAG helpers.

Needs the optional extra: `pip install "kvboost-integrations[langchain]"`.
"""
try:
    import langchain_core  # noqa: F401
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError('kvboost_integrations.langchain needs langchain-core: '
                      'pip install "kvboost-integrations[langchain]"') from err

from .chat_models import ChatKVBoost
from .llms import KVBoostLLM
from .messages import document_block
from .rag import document_blocks, document_messages, retrieval_messages, warm_documents
from .structured import LengthCutError

__all__ = ["ChatKVBoost", "KVBoostLLM", "LengthCutError", "document_block", "document_blocks", "document_messages",
           "retrieval_messages", "warm_documents"]
