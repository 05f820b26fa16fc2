"""kvboost engine: an embedded HF-transformers inference engine with chunked KV reuse."""
from .config import EngineConfig
from .engine import Engine
from .errors import (BudgetError, CancelledError, ContextWindowError, InputError, KVBoostError,
                     ModelNotFoundError, UnsupportedModelError)
from .generation import Generation, GenerationStream
from .prompt import Segment
from .shared import shared_engine

__all__ = [
    "Engine", "EngineConfig", "shared_engine", "Generation", "GenerationStream", "Segment",
    "KVBoostError", "InputError", "ContextWindowError", "ModelNotFoundError",
    "UnsupportedModelError", "BudgetError", "CancelledError",
]
__version__ = "0.1.0"
