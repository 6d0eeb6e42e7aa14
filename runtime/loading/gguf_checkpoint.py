"""GGUF checkpoints: a `.gguf` file, or a directory holding exactly one, as a model: its ModelConfig
(runtime.loading.gguf_archs) and its weights under the canonical names (runtime.loading.weights), each
de-quantized in memory to the engine dtype, or, with `keep_blocks`, each matmul weight stored in a
block format this runtime runs kept as its bytes (runtime.quantization.block_weights' row
segments; norms and float tensors as floats). The loader then checks them and takes a
tensor-parallel rank's slices. Called by runtime.engine.
"""
from __future__ import annotations

import logging
import os

import torch

from ..config import ConfigError
from ..quantization.block_weights import can_hold_blocks, segment_name
from ..quantization.gguf_blocks import FLOAT_TYPE_IDS, BlockFormat, format_of_type
from .gguf_archs import ROPE_FREQS, model_config_from_gguf
from .gguf_file import GgufFile
from .tensor_files import WeightError
from .weights import expected_shapes

logger = logging.getLogger(__name__)

GGUF_SUFFIX = ".gguf"
# canonical name -> GGUF name, outside the layers
GLOBAL_TO_GGUF = {"embed_tokens": "token_embd.weight", "position_embeddings": "position_embd.weight",
                  "embed_norm.weight": "token_embd_norm.weight", "embed_norm.bias": "token_embd_norm.bias",
                  "final_norm.weight": "output_norm.weight", "final_norm.bias": "output_norm.bias",
                  "lm_head": "output.weight", "lm_head.bias": "output.bias"}
# canonical layer tensor -> the ways a file may store it (GGUF names in `blk.{i}.`, concatenated along
# dim 0); the first way whose tensors are all in the file is read.
LAYER_TO_GGUF = {
    "input_norm": (("attn_norm",),),
    "post_norm": (("ffn_norm",),),
    "qkv": (("attn_qkv",), ("attn_q", "attn_k", "attn_v")),  # llama.cpp stores fused QKV as [q, k, v]
    "out": (("attn_output",),),
    "q_norm": (("attn_q_norm",),),
    "k_norm": (("attn_k_norm",),),
    "mlp_in": (("ffn_gate", "ffn_up"), ("ffn_up",)),         # ffn_up alone: fused gate-up (Phi-3) or no gate
    "mlp_out": (("ffn_down",),),
}


def find_gguf(path: str | os.PathLike) -> str | None:
    """The GGUF file `path` names: itself when it is a `.gguf` file, or the one `.gguf` file of a
    directory (None when there is none; ConfigError when there are several)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        return path if path.endswith(GGUF_SUFFIX) and os.path.exists(path) else None
    found = sorted(name for name in os.listdir(path) if name.endswith(GGUF_SUFFIX))
    if len(found) > 1:
        raise ConfigError(f"engine_dir: {path!r} holds {len(found)} GGUF files ({', '.join(found)}); name one")
    return os.path.join(path, found[0]) if found else None


def unpermute_rows(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's permutation of a LLaMA Q or K weight (or bias): per head it stores the rows of
    rotary pair i as (2i, 2i + 1) where transformers has them at (i, i + head_dim / 2)."""
    shape = tensor.shape
    return tensor.reshape(num_heads, shape[0] // num_heads // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)


class GgufCheckpoint:
    """An open GGUF file with its ModelConfig; `read_weights(dtype)` gives the canonical weights."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.file = GgufFile(self.path)
        self.model_config, self.arch = model_config_from_gguf(self.file)

    def __enter__(self) -> "GgufCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()

    @property
    def num_bytes_read(self) -> int:
        return self.file.num_bytes_read

    def read_weights(self, dtype: torch.dtype, keep_blocks: bool = False, strict: bool = True
                     ) -> dict[str, torch.Tensor]:
        """Every canonical tensor of the config, de-quantized to `dtype` (WeightError naming the GGUF
        tensor when one is missing or misshaped). keep_blocks: a matmul weight whose GGUF tensors
        are all in block formats is kept as its row segments (uint8; a block with a NaN or infinite
        scale is a WeightError naming the tensor); a part in another quantized type is a WeightError
        naming it when `strict` (keep asked for), else the weight is de-quantized (auto)."""
        cfg, used = self.model_config, set()
        weights = {}
        for name, shape in expected_shapes(cfg).items():
            parts = self._parts(name, shape)
            formats = self._kept_formats(name, parts, strict) if keep_blocks else None
            if formats is not None:
                weights.update(self._segments(name, parts, formats))
            else:
                tensors = [self._read_part(gguf_name, part_shape, name, dtype) for gguf_name, part_shape in parts]
                weights[name] = tensors[0] if len(tensors) == 1 else torch.cat(tensors)
            used.update(gguf_name for gguf_name, _ in parts)
        unused = sorted(set(self.file.tensors) - used - {ROPE_FREQS})
        if unused:
            logger.warning("%s: %d tensors not used by the %s model: %s", self.path, len(unused), cfg.architecture,
                           ", ".join(unused[:8]) + (", ..." if len(unused) > 8 else ""))
        return weights

    def _parts(self, name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
        """(GGUF name, its expected shape) of each part of canonical tensor `name`, in order."""
        if name in GLOBAL_TO_GGUF:
            return [(GLOBAL_TO_GGUF[name], shape)]
        _, layer, stem, kind = name.split(".")
        ways = self.arch.layer_to_gguf.get(stem, LAYER_TO_GGUF[stem])
        stems = next((way for way in ways if all(f"blk.{layer}.{s}.{kind}" in self.file.tensors for s in way)),
                     ways[0])
        cfg = self.model_config
        if len(stems) == 3:
            rows = (cfg.q_size, cfg.kv_size, cfg.kv_size)
        elif len(stems) == 2:
            rows = (cfg.intermediate_size, cfg.intermediate_size)
        else:
            rows = (shape[0],)
        return [(f"blk.{layer}.{s}.{kind}", (n, *shape[1:])) for s, n in zip(stems, rows)]

    def _info(self, gguf_name: str, shape: tuple[int, ...], name: str):
        info = self.file.tensors.get(gguf_name)
        if info is None:
            raise WeightError(f"{self.path}: missing tensor {gguf_name!r} (for {name!r})")
        if info.shape != shape:
            raise WeightError(f"{self.path}: tensor {gguf_name!r} has shape {list(info.shape)}, expected "
                              f"{list(shape)} from the metadata")
        return info

    def _unpermuted(self, tensor: torch.Tensor, gguf_name: str) -> torch.Tensor:
        """LLaMA's Q / K rows back in transformers' order (whole rows: floats or a row's blocks)."""
        if self.arch.permuted_qk and ".attn_q." in gguf_name:
            return unpermute_rows(tensor, self.model_config.num_heads)
        if self.arch.permuted_qk and ".attn_k." in gguf_name:
            return unpermute_rows(tensor, self.model_config.num_kv_heads)
        return tensor

    def _read_part(self, gguf_name: str, shape: tuple[int, ...], name: str, dtype: torch.dtype) -> torch.Tensor:
        self._info(gguf_name, shape, name)
        tensor = self.file.read(gguf_name)   # float32: the permutation, then one cast
        return self._unpermuted(tensor, gguf_name).to(dtype)

    def _kept_formats(self, name: str, parts: list[tuple[str, tuple[int, ...]]], strict: bool
                      ) -> list[BlockFormat] | None:
        """Each part's block format where canonical weight `name` is kept as blocks; None: read as
        floats (not a matmul weight, or a part stored as floats: the whole weight is de-quantized).
        WeightError naming the GGUF tensor for a quantized type this runtime does not run."""
        if not can_hold_blocks(name):
            return None
        formats = []
        for gguf_name, shape in parts:
            info = self._info(gguf_name, shape, name)
            fmt = format_of_type(info.type_id)
            if fmt is None and info.type_id not in FLOAT_TYPE_IDS and strict:
                raise WeightError(f"{self.path}: tensor {gguf_name!r}: type {info.type_name} is not a block format "
                                  f"this runtime runs (q8_0, q4_0, q4_1, q5_0, q4_k, q5_k, q6_k); load it with "
                                  "weight_format='dequantize' (--weight-format dequantize) to de-quantize it")
            formats.append(fmt)
        return None if None in formats else formats

    def _segments(self, name: str, parts: list[tuple[str, tuple[int, ...]]], formats: list[BlockFormat]
                  ) -> dict[str, torch.Tensor]:
        """`name`'s row segments: consecutive parts of one format concatenated (block_weights.py)."""
        groups: list[tuple[BlockFormat, list[torch.Tensor]]] = []
        for (gguf_name, _), fmt in zip(parts, formats):
            info = self.file.tensors[gguf_name]
            blocks = torch.from_numpy(self.file.raw(gguf_name).copy()).reshape(info.shape[0], -1)
            self.file.num_bytes_read += info.num_bytes
            try:
                fmt.check_blocks(blocks, gguf_name)
            except WeightError as e:
                raise WeightError(f"{self.path}: {e}") from None
            blocks = self._unpermuted(blocks, gguf_name)
            if groups and groups[-1][0] is fmt:
                groups[-1][1].append(blocks)
            else:
                groups.append((fmt, [blocks]))
        return {segment_name(name, index, fmt): torch.cat(tensors) if len(tensors) > 1 else tensors[0]
                for index, (fmt, tensors) in enumerate(groups)}

