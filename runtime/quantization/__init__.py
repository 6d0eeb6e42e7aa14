"""Weight formats as registry entries: one module per format (int8.py, int4.py) declares its config
value, QuantMode bits, quantization at load, stored layout, de-quantization (the torch reference),
tensor-parallel slicing and what the native kernels take; registry.py looks entries up by config
value or stored layout; stored.py applies them to a model's weights."""
from .format import WeightFormat
from .int4 import INT4
from .int8 import INT8
from .registry import (lookup, lookup_build, lookup_dtype, lookup_stored, register, split_part, supported_formats,
                       unregister)

__all__ = ["INT4", "INT8", "WeightFormat", "lookup", "lookup_build", "lookup_dtype", "lookup_stored", "register",
           "split_part", "supported_formats", "unregister"]
