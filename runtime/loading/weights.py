"""Weights: read safetensors checkpoints (HF layouts or our engine layout) into canonical tensors,
whole or one tensor-parallel rank's slices (runtime.parallel.tensor_parallel.TensorShard).

Canonical names (what the model uses; engine directories store exactly these):
  embed_tokens [V, H]; position_embeddings [P, H] (learned positions only);
  embed_norm.{weight,bias} [H] (embedding_norm only);
  layers.{i}.input_norm.{weight,bias}; layers.{i}.qkv.{weight,bias} [q + 2 kv, H] (fused: all query
  heads, then all key heads, then all value heads); layers.{i}.out.{weight,bias} [H, q];
  layers.{i}.post_norm.{weight,bias} (absent with a parallel residual sharing one norm);
  layers.{i}.mlp_in.{weight,bias} [I or 2 I (gate then up), H]; layers.{i}.mlp_out.{weight,bias} [H, I];
  final_norm.{weight,bias}; lm_head [V, H] (absent when tied to embed_tokens); lm_head.bias [V]
  (lm_head_bias only, tied or not).
Weights come from safetensors (or, de-quantized in memory, from a GGUF file: runtime.loading.gguf_checkpoint,
through `check_weights`): pickle files are never opened. Each architecture's reader
(runtime.models) maps its HF names onto these, as `LazyTensor`s (shapes and places in the files, no
data: runtime.loading.tensor_files); the loader checks the shapes, then reads each canonical tensor, or only
a rank's slice of it, by byte offsets.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Callable, Sequence, Union

import torch

from ..config import ModelConfig
from .tensor_files import LazyTensor, TensorSource, WeightError

__all__ = ["LazyTensor", "RawWeights", "TensorSource", "WeightError", "WeightReader", "Weights", "check_weights",
           "expected_shapes", "fused", "load_engine_weights", "load_hf_weights", "per_head_qkv", "renamed"]

if TYPE_CHECKING:
    from ..parallel.pipeline import StageLayers
    from ..parallel.tensor_shard import TensorShard

Weights = dict[str, torch.Tensor]
# What a reader returns: canonical name -> a lazy tensor (read by the loader) or one in memory.
RawWeights = dict[str, Union["LazyTensor", torch.Tensor]]
# Reads a checkpoint's tensors under the canonical names; one per architecture (runtime.models).
WeightReader = Callable[["TensorSource", ModelConfig], RawWeights]
# Tensors an engine stores quantized (runtime.quantization.stored): name -> (dtype, whole shape).
StoredLayout = dict[str, tuple[torch.dtype, tuple[int, ...]]]


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    qkv = cfg.q_size + 2 * cfg.kv_size
    has_norm_bias = cfg.norm_type == "layernorm"
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens": (v, h), "final_norm.weight": (h,)}
    if has_norm_bias:
        shapes["final_norm.bias"] = (h,)
    if cfg.position_embedding == "learned":
        shapes["position_embeddings"] = (cfg.max_position_embeddings, h)
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (v, h)
    if cfg.lm_head_bias:
        shapes["lm_head.bias"] = (v,)
    if cfg.embedding_norm:
        shapes["embed_norm.weight"] = (h,)
        if has_norm_bias:
            shapes["embed_norm.bias"] = (h,)
    mlp_in = 2 * i if cfg.mlp_type == "gated" else i
    for layer in range(cfg.num_layers):
        p = f"layers.{layer}."
        norms = ("input_norm", "post_norm") if cfg.has_post_norm else ("input_norm",)
        for norm in norms:
            shapes[p + norm + ".weight"] = (h,)
            if has_norm_bias:
                shapes[p + norm + ".bias"] = (h,)
        shapes[p + "qkv.weight"] = (qkv, h)
        if cfg.qk_norm:
            shapes[p + "q_norm.weight"] = shapes[p + "k_norm.weight"] = (cfg.head_dim,)
        shapes[p + "out.weight"] = (h, cfg.q_size)
        shapes[p + "mlp_in.weight"] = (mlp_in, h)
        shapes[p + "mlp_out.weight"] = (h, i)
        if cfg.qkv_bias:
            shapes[p + "qkv.bias"] = (qkv,)
        if cfg.out_bias:
            shapes[p + "out.bias"] = (h,)
        if cfg.mlp_bias:
            shapes[p + "mlp_in.bias"] = (mlp_in,)
            shapes[p + "mlp_out.bias"] = (h,)
    return shapes

# -- the readers' helpers and the loader ------------------------------------------------------------

def per_head_qkv(tensor: LazyTensor, num_heads: int, head_dim: int, name: str, directory: str) -> LazyTensor:
    """A fused QKV weight [num_heads * 3 * head_dim, ...] (or bias) laid out per head as [q_h, k_h, v_h]
    (GPT-NeoX, BLOOM, Falcon without multi-query) -> the canonical [all q, all k, all v] rows."""
    if tensor.shape[0] != 3 * num_heads * head_dim:
        raise WeightError(f"{directory}: tensor {name!r} has shape {list(tensor.shape)}, expected "
                          f"{3 * num_heads * head_dim} rows from the config")
    blocks = [(3 * head + part) * head_dim for part in range(3) for head in range(num_heads)]
    return tensor.take_rows([(start, start + head_dim) for start in blocks])


def renamed(get: Callable[[str], LazyTensor], ours: str, theirs: str, names: Sequence[tuple[str, str]],
            kinds: Sequence[str] = ("weight", "bias")) -> RawWeights:
    """{ours + a + "." + kind: get(theirs + b + "." + kind)} for each (a, b) of `names` and each kind:
    an architecture's tensors under the canonical names (`ours`, `theirs`: the layer prefixes)."""
    return {f"{ours}{a}.{kind}": get(f"{theirs}{b}.{kind}") for a, b in names for kind in kinds}


def fused(src: TensorSource, name_to_shape: dict[str, tuple[int, ...]]) -> LazyTensor:
    """Concatenate HF tensors along dim 0 (fused q/k/v, gate/up), naming any misshaped part."""
    parts = []
    for name, shape in name_to_shape.items():
        tensor = src.get(name)
        if tuple(tensor.shape) != shape:
            raise WeightError(f"{src.directory}: tensor {name!r} has shape {list(tensor.shape)}, "
                              f"expected {list(shape)} from the config")
        parts.append(tensor)
    return LazyTensor.cat_rows(parts)


def _checked(raw: RawWeights, cfg: ModelConfig, dtype: torch.dtype, where: str, src: TensorSource | None,
             shard: TensorShard | None, stored: StoredLayout | None = None, stage: StageLayers | None = None
             ) -> Weights:
    """Check every canonical tensor's presence, whole shape and dtype; then read each (the rank's
    slice of it with a shard; only the stage's tensors with a stage) and convert to `dtype`;
    `stored` names tensors read as they are (block segments, runtime.quantization.block_weights,
    in place of their canonical weight)."""
    from ..quantization.block_weights import block_bases, has_weight, parse_segment   # NOTE: lazy: no cycle
    stored = stored or {}
    kept = set(block_bases(stored))
    shapes = {**{name: shape for name, shape in expected_shapes(cfg).items() if name not in kept},
              **{name: shape for name, (_, shape) in stored.items()}}
    for name, shape in shapes.items():
        tensor = raw.get(name)
        if tensor is None:
            raise WeightError(f"{where}: missing tensor {name!r}")
        if tuple(tensor.shape) != shape:
            raise WeightError(f"{where}: tensor {name!r} has shape {list(tensor.shape)}, "
                              f"expected {list(shape)} from the config")
        if name in stored:
            if tensor.dtype != stored[name][0] and not _older_stored_dtype(tensor.dtype, stored[name][0]):
                raise WeightError(f"{where}: tensor {name!r} has dtype {tensor.dtype}, expected {stored[name][0]}")
        elif not tensor.is_floating_point():
            raise WeightError(f"{where}: tensor {name!r} has dtype {tensor.dtype}, expected floating point")
    out: Weights = {}
    tied = not has_weight(shapes, "lm_head")
    for name in shapes:
        if stage is not None and not stage.holds(name, tied):
            continue
        tensor, selection = raw[name], shard.selection(name, shapes) if shard is not None else None
        if isinstance(tensor, LazyTensor):
            tensor = src.read(tensor, selection)
        elif selection is not None:   # a reader that built it in memory
            tensor = shard.slice(name, tensor, shapes)
        out[name] = tensor.to(stored[name][0]).contiguous() if name in stored else tensor.to(dtype).contiguous()
        _check_finite(out[name], name, where)
        if name in stored and parse_segment(name) is not None:
            _check_blocks(out[name], name, where)
    return out


def _check_blocks(tensor: torch.Tensor, name: str, where: str) -> None:
    """WeightError naming `where` and the segment when a block holds a NaN or infinite scale."""
    from ..quantization.block_weights import parse_segment
    try:
        parse_segment(name)[2].check_blocks(tensor, name)
    except WeightError as e:
        raise WeightError(f"{where}: {e}") from None


def _older_stored_dtype(found: torch.dtype, expected: torch.dtype) -> bool:
    """A stored dtype of an older engine directory, converted at load: int4 scales and mins were
    float32 before they were float16."""
    return found == torch.float32 and expected == torch.float16


def _check_finite(tensor: torch.Tensor, name: str, where: str) -> None:
    """WeightError naming the tensor when a floating-point one holds NaN or infinity (in the dtype it
    runs in: a float32 value beyond float16's range becomes infinite). Without it a NaN weight loads
    and every request then fails at its first token.
    NOTE: a finite sum proves every element finite (NaN and inf propagate through a sum) in one
    reduction, 8-10x faster than isfinite(...).all() (a [4096, 11008] tensor, 2 CPU cores: 16 ms
    float32 and 12 ms bfloat16, against 140 and 131 ms; a copy of it takes 46 and 25 ms); only a sum
    that is not finite (a NaN, or finite values summing past the dtype's range) takes the exact pass."""
    if not tensor.is_floating_point() or bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all()):
        return
    num_nan = int(torch.isnan(tensor).sum())
    raise WeightError(f"{where}: tensor {name!r} holds {num_nan} NaN and {int(torch.isinf(tensor).sum())} infinite "
                      f"values (as {tensor.dtype}); a model with them computes NaN logits")


def check_weights(raw: dict[str, torch.Tensor], cfg: ModelConfig, dtype: torch.dtype, where: str,
                  shard: TensorShard | None = None, stage: StageLayers | None = None,
                  stored: StoredLayout | None = None) -> Weights:
    """Canonical weights a reader built in memory (a GGUF's, de-quantized or its block segments as
    `stored` lays them out): checked as a checkpoint's are, then whole or the shard's slices, in `dtype`."""
    return _checked(raw, cfg, dtype, where, None, shard, stored, stage)


def load_hf_weights(directory: str, cfg: ModelConfig, dtype: torch.dtype, read: WeightReader,
                    shard: TensorShard | None = None, stage: StageLayers | None = None) -> tuple[Weights, int]:
    """(canonical weights, whole or the shard's slices; tensor bytes read from the files)."""
    with TensorSource(directory) as src:
        return _checked(read(src, cfg), cfg, dtype, directory, src, shard, stage=stage), src.num_bytes_read


def load_engine_weights(path: str, cfg: ModelConfig, dtype: torch.dtype, shard: TensorShard | None = None,
                        stored: StoredLayout | None = None, stage: StageLayers | None = None) -> tuple[Weights, int]:
    """(canonical weights, whole or the shard's slices; tensor bytes read from the files).
    `stored`: the weight-only tensors (runtime.quantization.stored.stored_layout), read as they are."""
    with TensorSource(os.path.dirname(path)) as src:
        names = {**expected_shapes(cfg), **(stored or {})}
        raw = {name: src.get(name) for name in names if name in src.names()}
        return _checked(raw, cfg, dtype, path, src, shard, stored, stage), src.num_bytes_read


def weights_fingerprint(weights: dict[str, torch.Tensor]) -> str:
    """blake2b over each weight's name, shape, dtype and its first and last 32 elements' bytes: two
    instances whose fingerprints differ hold different weights (a different checkpoint of the same
    shape is caught with near certainty; equal fingerprints do not prove equal weights)."""
    import hashlib
    digest = hashlib.blake2b(digest_size=8)
    for name in sorted(weights):
        t = weights[name]
        digest.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
        flat = t.detach().reshape(-1)
        for part in (flat[:32], flat[-32:]):
            digest.update(part.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
