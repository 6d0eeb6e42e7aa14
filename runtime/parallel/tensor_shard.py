"""Which slice of every weight a tensor-parallel rank holds: `TensorShard`, plain arithmetic
over the model's config and the canonical weight layout (runtime.loading.weights).

The split (Megatron's): q/k/v and the MLP's up/gate are column-parallel (a rank computes its heads
and its intermediate columns), the attention output and the MLP's down projection are
row-parallel (each rank a partial sum, summed by an all-reduce), the embedding and lm_head are
vocab-parallel (a masked lookup plus an all-reduce; the logits gathered where the decoder runs).
KV heads split like the query heads; with fewer KV heads than ranks each rank keeps the one its
query heads read (replicated), so each rank's KV pool holds only the heads it attends with.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..quantization import WeightFormat, lookup_stored, split_part
from ..quantization.block_weights import is_segment, parse_segment, segment_spans
from ..quantization.format import Ranges


def num_local_kv_heads(num_kv_heads: int, size: int) -> int:
    """KV heads each of `size` ranks holds (one, replicated, when there are fewer than ranks)."""
    return max(1, num_kv_heads // size)


def _spans(start: int, stop: int) -> Ranges:
    return ((start, stop),) if stop > start else ()


@dataclass(frozen=True)
class TensorShard:
    """Rank `rank` of `size`: the heads, intermediate columns and vocabulary rows it holds.

    Weights are in the canonical layout (runtime.loading.weights): qkv rows [all q, all k, all v],
    mlp_in rows [gate, up] (gated) or [fc], out and mlp_out [hidden, in]."""
    rank: int
    size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    gated_mlp: bool

    @staticmethod
    def of(cfg: ModelConfig, rank: int, size: int) -> "TensorShard":
        """ValueError naming the field when `cfg` does not split over `size` ranks."""
        if not 0 <= rank < size:
            raise ValueError(f"rank: expected 0 <= rank < {size}, got {rank}")
        if cfg.num_heads % size:
            raise ValueError(f"tensor_parallelism: {size} does not divide the model's num_heads {cfg.num_heads}")
        kv = cfg.num_kv_heads
        if (kv >= size and kv % size) or (kv < size and size % kv):
            raise ValueError(f"tensor_parallelism: {size} ranks cannot share the model's {kv} KV heads "
                             "(one must divide the other)")
        if cfg.intermediate_size % size:
            raise ValueError(f"tensor_parallelism: {size} does not divide the model's intermediate_size "
                             f"{cfg.intermediate_size}")
        return TensorShard(rank, size, cfg.num_heads, kv, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size,
                           cfg.mlp_type == "gated")

    # -- what this rank holds ---------------------------------------------------------------------

    @property
    def num_local_heads(self) -> int:
        return self.num_heads // self.size

    @property
    def num_local_kv_heads(self) -> int:
        return num_local_kv_heads(self.num_kv_heads, self.size)

    @property
    def first_head(self) -> int:
        return self.rank * self.num_local_heads

    @property
    def first_kv_head(self) -> int:
        """Its first KV head; with fewer KV heads than ranks, the one its query heads read."""
        if self.num_kv_heads >= self.size:
            return self.rank * self.num_local_kv_heads
        return self.rank * self.num_kv_heads // self.size

    @property
    def num_local_intermediate(self) -> int:
        return self.intermediate_size // self.size

    @property
    def vocab_chunk(self) -> int:
        """Rows of every rank's (padded) vocabulary slice: ceil(vocab / size)."""
        return -(-self.vocab_size // self.size)

    @property
    def vocab_range(self) -> tuple[int, int]:
        """[start, stop) of the vocabulary rows it holds (the last rank's may be shorter or empty)."""
        start = min(self.rank * self.vocab_chunk, self.vocab_size)
        return start, min(start + self.vocab_chunk, self.vocab_size)

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The config of the slice the rank computes: its heads and intermediate columns (the
        vocabulary stays whole: ids and logits are global)."""
        return dataclasses.replace(cfg, num_heads=self.num_local_heads, num_kv_heads=self.num_local_kv_heads,
                                   intermediate_size=self.num_local_intermediate)

    def head_index(self) -> torch.Tensor:
        """int64 [local heads]: the global index of each query head (ALiBi slopes)."""
        return torch.arange(self.first_head, self.first_head + self.num_local_heads)

    # -- the slices of the canonical weights -----------------------------------------------------

    def qkv_rows(self) -> Ranges:
        d, q_size, kv_size = self.head_dim, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q0, k0 = self.first_head * d, self.first_kv_head * d
        nq, nk = self.num_local_heads * d, self.num_local_kv_heads * d
        return (*_spans(q0, q0 + nq), *_spans(q_size + k0, q_size + k0 + nk),
                *_spans(q_size + kv_size + k0, q_size + kv_size + k0 + nk))

    def out_columns(self) -> Ranges:
        d = self.head_dim
        return _spans(self.first_head * d, (self.first_head + self.num_local_heads) * d)

    def intermediate_columns(self) -> Ranges:
        n = self.num_local_intermediate
        return _spans(self.rank * n, (self.rank + 1) * n)

    def mlp_in_rows(self) -> Ranges:
        (start, stop), = self.intermediate_columns()
        if not self.gated_mlp:
            return ((start, stop),)
        i = self.intermediate_size
        return ((start, stop), (i + start, i + stop))

    def selection(self, name: str, shapes: Mapping[str, tuple[int, ...]] | None = None
                  ) -> tuple[int, Ranges] | None:
        """(dim, spans) of the canonical weight `name` this rank holds, or None: it holds it whole
        (norms, position embeddings, the row-parallel linears' biases).

        A weight-only tensor (runtime.quantization: `W` and its parts `W_scale`, ...) takes its
        float weight's rows; of a row-parallel weight's input columns, each part takes what its
        format says (WeightFormat.column_spans). `shapes` (whole shapes by name) tells a quantized
        weight's format; a span that splits a group is a ConfigError naming group_size.
        A block segment (`W@i.<format>`, runtime.quantization.block_weights) takes whole rows of
        its own, or whole blocks of its columns: a span that cuts a block is a ConfigError naming W."""
        if is_segment(name):
            sel = self._float_selection(parse_segment(name)[0])
            if sel is None:
                return None
            assert shapes is not None, f"{name}: a block segment's slice needs the weights' shapes"
            return sel[0], segment_spans(name, sel[0], sel[1], shapes, self.size)
        base, suffix = split_part(name)
        sel = self._float_selection(base)
        weight_format = None if shapes is None else lookup_stored(shapes, base)
        if sel is None or sel[0] == 0 or weight_format is None:
            return sel
        part_shapes = {part: shapes[base + part] for part in ("", *weight_format.suffixes)}
        spans = weight_format.column_spans(suffix, sel[1], part_shapes, base, self.size)
        return None if spans is None else (1, spans)

    def _float_selection(self, name: str) -> tuple[int, Ranges] | None:
        suffix = name.rsplit(".", 2)
        linear = suffix[-2] if len(suffix) >= 2 and name.startswith("layers.") else None
        if name in ("embed_tokens", "lm_head", "lm_head.bias"):
            return 0, _spans(*self.vocab_range)
        if linear == "qkv":
            return 0, self.qkv_rows()
        if linear == "mlp_in":
            return 0, self.mlp_in_rows()
        if linear == "out" and name.endswith(".weight"):
            return 1, self.out_columns()
        if linear == "mlp_out" and name.endswith(".weight"):
            return 1, self.intermediate_columns()
        return None

    def check_weight_format(self, weight_format: WeightFormat, group_size: int) -> None:
        """ConfigError naming group_size when a group of `weight_format` would straddle two ranks'
        input columns of a row-parallel linear (the attention output's or the MLP down projection's)."""
        weight_format.check_shard(self.out_columns(), self.intermediate_columns(), group_size, self.size)

    def local_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the rank's slice of a canonical weight of `shape` (a float one)."""
        sel = self.selection(name)
        if sel is None:
            return tuple(shape)
        dim, spans = sel
        out = list(shape)
        out[dim] = sum(stop - start for start, stop in spans)
        return tuple(out)

    def slice(self, name: str, tensor: torch.Tensor, shapes: Mapping[str, tuple[int, ...]] | None = None
              ) -> torch.Tensor:
        """The rank's slice of a whole canonical weight held in memory (GptSession given a whole
        engine; LoRA factors); `shapes` as for `selection`. Loading from files reads only the
        slice: runtime.loading.weights."""
        sel = self.selection(name, shapes)
        if sel is None:
            return tensor
        return take(tensor, *sel)


def take(tensor: torch.Tensor, dim: int, spans: Ranges) -> torch.Tensor:
    """The spans of `tensor` along `dim`, concatenated (a copy)."""
    parts = [tensor.narrow(dim, start, stop - start) for start, stop in spans]
    if not parts:
        shape = list(tensor.shape)
        shape[dim] = 0
        return tensor.new_empty(shape)
    return torch.cat(parts, dim).contiguous() if len(parts) > 1 else parts[0].contiguous()
