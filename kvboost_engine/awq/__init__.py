"""AWQ 4-bit checkpoints: format, compute layouts, loader and a small quantizer."""
from .format import AWQConfig, awq_config_of
from .loader import AWQInfo, load_awq_model

__all__ = ["AWQConfig", "awq_config_of", "AWQInfo", "load_awq_model"]
