"""Architecture registry: one module per family maps HF configs and tensor names onto ModelConfig
and the canonical weights; shared code looks entries up and branches only on variant fields."""
from .base import Architecture
from .registry import (lookup, lookup_hf, model_config_from_dict, model_config_from_hf, register,
                       supported_architectures, unregister)

SUPPORTED_ARCHITECTURES = supported_architectures()  # the built-in entries

__all__ = ["Architecture", "SUPPORTED_ARCHITECTURES", "lookup", "lookup_hf", "model_config_from_dict",
           "model_config_from_hf", "register", "supported_architectures", "unregister"]
