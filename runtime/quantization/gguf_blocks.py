"""llama.cpp's quantized block formats kept at run time, one entry per format: q8_0, q4_0, q4_1,
q5_0, q4_k, q5_k, q6_k. Each `BlockFormat` declares its geometry (values and bytes per block, the
ggml type id), its de-quantization (torch, bit for bit `gguf.quants.dequantize`), its quantizer
(our numpy code: block_codecs.py, k_quants.py) and the checks a stored tensor must pass (finite
float16 scales; whole blocks per row). A weight in one is held as its stored bytes, uint8
[rows, row_bytes] with row_bytes = columns / block_elems * block_bytes (ggml's rows).

NOTE: these are not `WeightFormat` registry entries. The registry's formats are chosen per engine
(BuildConfig.weight_only), quantize at load and are told apart by W's dtype and part names; every
block format is one uint8 tensor and a GGUF file picks one per TENSOR. So a block weight carries
its format in its stored name (block_weights.py: `W@<segment>.<format>`) and engine.json records
each weight's format ("weight_formats"); this table is looked up by that name or by the ggml type.
Torch and numpy only; used by runtime.loading (GGUF reads), block_weights.py and the kernels.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..errors import ConfigError
from ..loading.tensor_files import WeightError
from . import block_codecs as codecs
from . import k_quants


@dataclass(frozen=True)
class BlockFormat:
    name: str                 # lowercase: engine.json, stored names, the native kernels' format argument
    type_name: str            # gguf.GGMLQuantizationType's name ("Q4_K")
    type_id: int              # ggml's type id
    block_elems: int          # values per block
    block_bytes: int          # bytes per block
    scale_offsets: tuple[int, ...]   # byte offsets of each block's float16 scales (checked finite)
    dequantize_blocks: Callable[[torch.Tensor], torch.Tensor]   # uint8 [b, block_bytes] -> float32 [b, elems]
    quantize_blocks: Callable[[np.ndarray], np.ndarray]         # float32 [b, elems] -> uint8 [b, block_bytes]

    def row_bytes(self, columns: int) -> int:
        return columns // self.block_elems * self.block_bytes

    def columns(self, row_bytes: int) -> int:
        """The values per row of a stored tensor whose rows are `row_bytes` long."""
        return row_bytes // self.block_bytes * self.block_elems

    def check_columns(self, columns: int, name: str) -> None:
        """ConfigError naming the tensor unless its rows are whole blocks."""
        if columns <= 0 or columns % self.block_elems:
            raise ConfigError(f"tensor {name!r}: rows of {columns} values are not whole {self.name} blocks of "
                              f"{self.block_elems}")

    def dequantize(self, blocks: torch.Tensor) -> torch.Tensor:
        """uint8 [rows, row_bytes] -> float32 [rows, columns]."""
        rows, row_bytes = blocks.shape
        flat = blocks.reshape(-1, self.block_bytes)
        return self.dequantize_blocks(flat).reshape(rows, self.columns(row_bytes))

    def quantize(self, values: np.ndarray | torch.Tensor, name: str = "values") -> np.ndarray:
        """float [rows, columns] (columns whole blocks; finite) -> uint8 [rows, row_bytes]."""
        values = np.ascontiguousarray(values.float().numpy() if isinstance(values, torch.Tensor) else values,
                                      dtype=np.float32)
        self.check_columns(values.shape[-1], name)
        if not np.isfinite(values).all():
            raise ValueError(f"{name}: the values to quantize as {self.name} hold NaN or infinity")
        packed = self.quantize_blocks(values.reshape(-1, self.block_elems))
        return packed.reshape(*values.shape[:-1], self.row_bytes(values.shape[-1]))

    def check_blocks(self, blocks: torch.Tensor, name: str) -> None:
        """WeightError naming the tensor when a block's float16 scale is NaN or infinite (the
        de-quantized weight would be, and every request then computes NaN logits)."""
        if blocks.numel() == 0:
            return
        view = blocks.reshape(-1, self.block_bytes)
        for at in self.scale_offsets:
            scales = view[:, at:at + 2].contiguous().view(torch.float16)
            bad = ~torch.isfinite(scales)
            if bool(bad.any()):
                first = int(bad.reshape(-1).nonzero()[0])
                raise WeightError(f"tensor {name!r}: {int(bad.sum())} {self.name} blocks hold a NaN or infinite "
                                  f"float16 scale (the first: block {first}, byte {at})")


def _k_quantizer(type_name: str) -> Callable[[np.ndarray], np.ndarray]:
    return lambda blocks: k_quants.quantize(blocks, type_name)


def _entry(name: str, type_id: int, elems: int, nbytes: int, scales: tuple[int, ...], dequantize, quantize
           ) -> BlockFormat:
    return BlockFormat(name, name.upper(), type_id, elems, nbytes, scales, dequantize, quantize)


# ggml's type ids (gguf.GGMLQuantizationType); a test checks them and the geometry against the package.
BLOCK_FORMATS: dict[str, BlockFormat] = {f.name: f for f in (
    _entry("q8_0", 8, 32, 34, (0,), codecs.dequantize_q8_0, codecs.quantize_q8_0),
    _entry("q4_0", 2, 32, 18, (0,), codecs.dequantize_q4_0, codecs.quantize_q4_0),
    _entry("q4_1", 3, 32, 20, (0, 2), codecs.dequantize_q4_1, codecs.quantize_q4_1),
    _entry("q5_0", 6, 32, 22, (0,), codecs.dequantize_q5_0, codecs.quantize_q5_0),
    _entry("q4_k", 12, 256, 144, (0, 2), codecs.dequantize_q4_k, _k_quantizer("Q4_K")),
    _entry("q5_k", 13, 256, 176, (0, 2), codecs.dequantize_q5_k, _k_quantizer("Q5_K")),
    _entry("q6_k", 14, 256, 210, (208,), codecs.dequantize_q6_k, _k_quantizer("Q6_K")),
)}
_TYPE_TO_FORMAT = {f.type_id: f for f in BLOCK_FORMATS.values()}
FLOAT_TYPE_IDS = (0, 1, 30)   # ggml's F32, F16, BF16: read as floats, never kept as blocks


def block_format(name: object, what: str) -> BlockFormat:
    """The entry named `name`, or ConfigError naming `what` (a tensor) and the value."""
    found = BLOCK_FORMATS.get(name) if isinstance(name, str) else None
    if found is None:
        raise ConfigError(f"{what}: unknown weight format {name!r}; supported: {', '.join(BLOCK_FORMATS)}")
    return found


def format_of_type(type_id: int) -> BlockFormat | None:
    """The entry of ggml type `type_id`; None: not a kept block format (a float type or one we do not run)."""
    return _TYPE_TO_FORMAT.get(type_id)
