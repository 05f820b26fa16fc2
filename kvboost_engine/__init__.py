"""kvboost engine: an embedded HF-transformers inference engine with chunked KV reuse.

Rooms (see ARCHITECTURE.md): request/ (one request, prompt to reply), kv/ (the pool, the chunk
cache, the disk tier), model/ (the only code that knows transformers internals), weights/
(layer streaming, AWQ), constrained/ (the logits-constraint hook).
"""
from .config import EngineConfig
from .engine import Engine
from .errors import (BudgetError, ContextWindowError, InputError, KVBoostError, ModelNotFoundError,
                     QueueFullError, RequestTimeoutError, UnsupportedModelError)
from .instrument import FirstTokenEvent, ForwardEvent, Instruments
from .registry import release_shared_engines, shared_engine
from .request.generation import Generation, GenerationStream
from .request.logprobs import TextDelta
from .request.prompt import Segment

__all__ = [
    "Engine", "EngineConfig", "shared_engine", "release_shared_engines", "Generation", "GenerationStream", "Segment", "TextDelta",
    "KVBoostError", "InputError", "ContextWindowError", "ModelNotFoundError",
    "UnsupportedModelError", "BudgetError", "QueueFullError", "RequestTimeoutError", "Instruments", "ForwardEvent", "FirstTokenEvent",
]
__version__ = "0.1.0"
