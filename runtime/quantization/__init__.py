"""Weight formats as registry entries: one module per format (int8.py, int4.py) declares its config
value, QuantMode bits, quantization at load, stored layout, de-quantization (the torch reference),
tensor-parallel slicing and what the native kernels take; registry.py looks entries up by config
value or stored layout; stored.py applies them to a model's weights. llama.cpp's block formats,
one per tensor of a GGUF file, are a table of their own (gguf_blocks.py; block_weights.py: how a
weights dict and engine.json hold them)."""
from .format import WeightFormat
from .gguf_blocks import BLOCK_FORMATS, BlockFormat
from .int4 import INT4
from .int8 import INT8
from .registry import (lookup, lookup_build, lookup_dtype, lookup_stored, register, split_part, supported_formats,
                       unregister)

__all__ = ["BLOCK_FORMATS", "BlockFormat", "INT4", "INT8", "WeightFormat", "lookup", "lookup_build", "lookup_dtype", "lookup_stored", "register",
           "split_part", "supported_formats", "unregister"]
