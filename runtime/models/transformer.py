"""The decoder-only transformer: one implementation parameterised by ModelConfig.

Computes a packed step (`StepLayout`, built by the model runner) over the paged KV pool. Every
weight is applied once per layer to all tokens of all sequences (fused QKV, fused gate/up);
attention splits into the batched generation path (one query per sequence) and the context
path (one call per context sequence). Block variants come from ModelConfig fields only (positions,
rotary style and fraction, residual, norms, embedding norm, biases), never from the architecture.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .alibi import alibi_slopes
from ..config import ModelConfig
from ..kernels.interface import KernelBackend, PreparedLinear
from ..kernels.kv_quant import round_trip
from ..adapters.lora_step import LoraStepPlan
from .rope import apply_rope, rope_cos_sin, rope_inv_freq
from ..parallel.pipeline import StageLayers
from ..parallel.tensor_parallel import TensorParallel
from ..parallel.tensor_shard import TensorShard
from ..quantization.block_weights import block_bases, dequantize_rows, has_weight, padded_segments, segments_of
from ..quantization.registry import lookup_stored
from ..quantization.stored import is_quantized, padded_rows, stored_parts
from ..loading.weights import Weights

_ACTIVATIONS = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "silu": F.silu,
    "swish": F.silu,
    "relu": F.relu,
}


@dataclass
class StepLayout:
    """Per-step metadata shared by all layers (device tensors unless noted)."""
    input_ids: torch.Tensor            # int64 [T]
    position_ids: torch.Tensor         # int64 [T]
    slot_mapping: torch.Tensor         # int64 [T]: block_id * tokens_per_block + offset
    logits_token_index: torch.Tensor   # int64 [L]: tokens whose logits are `logits` (each sequence's last
                                       # num_logits new tokens, in order; L = S without drafts)
    generation_seq_ids: torch.Tensor   # int64 [G]: sequences with exactly one new token
    generation_token_index: torch.Tensor  # int64 [G]: their token index in T
    generation_block_tables: torch.Tensor  # int32 [G, max_blocks]
    generation_seq_lens: torch.Tensor  # int64 [G]: cached tokens incl. the new one
    context_spans: list[tuple[int, int, int, int]]  # host: (seq, token_start, num_tokens, past_len)
    block_tables: torch.Tensor         # int32 [S, max_blocks]
    context_logits_index: torch.Tensor | None  # int64 [C]: tokens whose logits are returned
    lora: LoraStepPlan | None = None   # the step's adapters and their token rows
    prompt_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None  # (token index int64 [P], rows [P, H]):
                                       # prompt-tuning rows that replace those tokens' embeddings


class Transformer:
    def __init__(self, config: ModelConfig, weights: Weights, device: torch.device, kernels: KernelBackend,
                 attention_window: int | None = None, sink_token_length: int = 0,
                 linear_impl: str | None = None, tensor_parallel: TensorParallel | None = None,
                 shard: TensorShard | None = None, gather_logits_to_all: bool = True,
                 stage: StageLayers | None = None, act_quant: str | None = None):
        """kernels: the backend of every op the model runs (its matmul weights are prepared by it
        here, once). attention_window: the window every layer uses (None = full causal attention);
        the caller folds the model's own sliding window in. sink_token_length: keys at positions
        below it stay visible outside the window (only with a window). linear_impl: forces a CPU
        matmul kernel (one of runtime.kernels.torch_kernels.linear.CPU_IMPLS; default: the fastest available).
        tensor_parallel, shard: this rank's world and the slices `weights` hold (TensorShard);
        gather_logits_to_all: every rank gets the logits (else rank 0 only, the others None).
        stage: the pipeline stage's layers `weights` hold (runtime.parallel.pipeline); None: all.
        act_quant: the build's BuildConfig.act_quant: the weight-only matmuls quantize their
        activations ("int8"), or None (exact)."""
        self.config = config
        self.kernels = kernels
        self.tp, self.shard = tensor_parallel, shard
        self.gather_logits_to_all = gather_logits_to_all
        # The heads and intermediate columns this rank computes (the whole model without TP).
        self.local = shard.local_config(config) if shard is not None else config
        # Row-parallel linears add their bias on one rank only (the all-reduce sums the partials).
        self.is_reducing_rank = tensor_parallel is None or tensor_parallel.rank == 0
        self.attention_window = attention_window
        self.sink_token_length = sink_token_length if attention_window is not None else 0
        self.w = {name: t.to(device) for name, t in weights.items()}
        self.device = device
        self.layers = range(config.num_layers) if stage is None else range(stage.start, stage.stop)
        self.is_first_stage = stage is None or stage.is_first
        self.is_last_stage = stage is None or stage.is_last
        # the compute dtype (a weight-only table may be int8)
        self.dtype = self.w[f"layers.{self.layers.start}.input_norm.weight"].dtype
        # A tied weight-only table: its format and stored parts, read de-quantized a row at a time
        self.embed_format = lookup_stored(self.w, "embed_tokens") if "embed_tokens" in self.w else None
        self.embed_parts = stored_parts(self.w, "embed_tokens") if self.embed_format is not None else None
        # A table kept in a GGUF block format (block_weights.py): only the looked-up rows de-quantized
        self.embed_is_blocks = bool(segments_of(self.w, "embed_tokens"))
        self.embed_rows_from_head = False   # set by _prepare_head for a tied block table
        self.scale = 1.0 / math.sqrt(config.head_dim)
        act = _ACTIVATIONS.get(config.activation)
        if act is None:
            raise ValueError(f"activation: unsupported {config.activation!r}; supported: {sorted(_ACTIVATIONS)}")
        self.act = act
        # NOTE: on CPU the MLP runs over row chunks of a long step: a [1024, 2 * intermediate]
        # activation stays cache-friendly and is reused by the allocator, where a whole 6400-token
        # step's (tens of MB) is a fresh page-faulted mmap per layer. Measured 3.08 -> 2.47 s per
        # 6400-token context step on the default model (512 and 2048 rows: 2.56 and 2.61 s).
        self.mlp_chunk_rows = 1024 if device.type == "cpu" else None
        self.inv_freq = (rope_inv_freq(config.rope, config.rotary_dim).to(device)
                         if config.position_embedding == "rope" else None)
        # float32 [num_heads]: the ALiBi slope of each query head (None without ALiBi). The kernels
        # bias by cache positions (a key's index in its sequence), which position_ids do not change.
        self.alibi_slopes = None
        if config.position_embedding == "alibi":   # a rank's heads take their own slopes
            slopes = alibi_slopes(config.num_heads)
            self.alibi_slopes = (slopes[shard.head_index()] if shard is not None else slopes).to(device)
        self.act_quant = act_quant
        self.linears: dict[str, PreparedLinear] = {}
        linear_suffixes = (".qkv.weight", ".out.weight", ".mlp_in.weight", ".mlp_out.weight")
        for name in [n for n in [*self.w, *block_bases(self.w)] if n.endswith(linear_suffixes)]:
            prefix = name[:-len(".weight")]
            bias = self.w.get(prefix + ".bias")
            if not self.is_reducing_rank and prefix.endswith(("out", "mlp_out")):
                bias = None
            self.linears[prefix] = self._prepare_linear(self.w, name, bias, linear_impl)
            if name in self.w:
                self._hold_prepared(name, self.linears[prefix])
            else:   # block segments, under their own names
                self._hold_segments(name, self.linears[prefix])
        self.lm_head = None   # the last pipeline stage's (every rank's without one)
        if self.is_last_stage:
            self._prepare_head(linear_impl)

    def _prepare_head(self, linear_impl: str | None) -> None:
        """Tied embeddings: one table. A float one is the head's weight where the CPU kernel reads
        it as stored (a reordered head is a second copy); a quantized one is the head's as prepared
        (repacked for act_quant), the lookup reading its rows. Under TP each rank's head is padded
        with zero rows to the vocab chunk (the gather needs equal parts; the padding columns are dropped)."""
        shard = self.shard
        head_name = "lm_head" if has_weight(self.w, "lm_head") else "embed_tokens"
        head_bias, head_weights = self.w.get("lm_head.bias"), self.w
        segments = segments_of(self.w, head_name)
        num_rows = sum(self.w[n].shape[0] for n, _ in segments) if segments else self.w[head_name].shape[0]
        if shard is not None and num_rows < shard.vocab_chunk:
            pad = shard.vocab_chunk - num_rows
            head_weights = ({**self.w, **padded_segments(self.w, head_name, pad)} if segments
                            else padded_rows(self.w, head_name, pad))
            head_bias = F.pad(head_bias, (0, pad)) if head_bias is not None else None
        self.lm_head = self._prepare_linear(head_weights, head_name, head_bias, linear_impl)
        if segments:
            self._hold_segments(head_name, self.lm_head)
            # a tied table's lookup reads the head's rows (in the layout its kernels hold)
            self.embed_rows_from_head = head_name == "embed_tokens"
            return
        if head_name == "embed_tokens" and self.embed_format is not None and \
                self.lm_head.weight is not self.w["embed_tokens"]:
            # One copy of a tied quantized table: the head's (repacked) one, whose rows the lookup reads
            self.embed_parts = None
            self._hold_prepared("embed_tokens", self.lm_head)
        elif "lm_head" in self.w or self.lm_head.weight is not self.w["embed_tokens"]:
            self.w["lm_head"] = held = self.lm_head.weight
            table = self.w.get("embed_tokens") if head_name == "embed_tokens" and held.layout == torch.strided else None
            if table is not None and held.dtype == table.dtype and held[:len(table)].shape == table.shape:
                # One copy of a tied float table: the head's (in huge pages; padded under TP), its first rows
                self.w["embed_tokens"] = held[:len(table)]

    def _hold_prepared(self, name: str, linear: PreparedLinear) -> None:
        """The prepared tensors replace the weight `name` (and its stored parts) in self.w: the
        model holds one copy, the one its kernels read."""
        self.w[name] = linear.weight
        weight_format = lookup_stored(self.w, name)
        if weight_format is not None:
            for suffix, part in zip(weight_format.suffixes, linear.parts, strict=True):
                self.w[name + suffix] = part

    def _hold_segments(self, name: str, linear: PreparedLinear) -> None:
        """The block segments the prepared linear holds (repacked where its kernels read another
        layout) replace those of `name` in self.w: one copy."""
        for (segment_name, _), held in zip(segments_of(self.w, name), linear.segment_tensors(), strict=True):
            self.w[segment_name] = held

    def _prepare_linear(self, weights: Weights, name: str, bias: torch.Tensor | None,
                        linear_impl: str | None) -> PreparedLinear:
        """The matmul weight `name` of `weights` (weight-only quantized, block segments or float),
        prepared by the backend."""
        segments = segments_of(weights, name)
        if segments:
            return self.kernels.prepare_block_linear([(fmt, weights[n]) for n, fmt in segments], bias)
        if is_quantized(weights, name):
            weight, *parts = stored_parts(weights, name)
            return self.kernels.prepare_weight_only_linear(weight, *parts, *[None] * (2 - len(parts)), bias,
                                                           self.act_quant)
        return self.kernels.prepare_linear(weights[name], bias, linear_impl)

    def weight_tensors(self) -> list[torch.Tensor]:
        """Every weight tensor the model holds, each once (tied and aliased ones counted once)."""
        unique = {}
        for t in self.w.values():
            # oneDNN-reordered weights are opaque (no data pointer) and never aliased.
            unique.setdefault(id(t) if t.is_mkldnn else t.data_ptr(), t)
        return list(unique.values())

    def _norm(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        weight = self.w[prefix + ".weight"]
        if self.config.norm_type == "layernorm":
            return F.layer_norm(x, (x.shape[-1],), weight, self.w[prefix + ".bias"], self.config.norm_eps)
        return self.kernels.rms_norm(x, weight, self.config.norm_eps)

    def forward(self, step: StepLayout, kv_pool: torch.Tensor, kv_scales: torch.Tensor | None = None,
                hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """kv_pool [num_layers, 2, num_blocks, tpb, kvH, D] (the stage's layers) -> (logits float32
        [L, V], context logits float32 [C, V] or None). kv_scales float32 [num_layers, 2,
        num_blocks, tpb, kvH]: the scales of a quantized pool (int8 / fp8), None otherwise. A
        pipeline stage after the first starts from the previous stage's `hidden` [T, H]; one before
        the last returns its own (hidden [T, H], None)."""
        cfg, w = self.config, self.w
        if self.is_first_stage:
            x = self._embed(step.input_ids)  # [T, H]
            if step.prompt_embeddings is not None:
                x[step.prompt_embeddings[0]] = step.prompt_embeddings[1]
            if cfg.embedding_norm:
                x = self._norm(x, "embed_norm")
            if cfg.position_embedding == "learned":
                x = x + w["position_embeddings"][step.position_ids]
        else:
            x = hidden
        cos = sin = None
        if cfg.position_embedding == "rope":
            cos, sin = rope_cos_sin(self.inv_freq, step.position_ids, self.dtype, cfg.rotary_style)
        first = self.layers.start
        for layer in self.layers:
            p = f"layers.{layer}."
            h = self._norm(x, p + "input_norm")
            qkv = self._linear(h, p + "qkv", step.lora)
            i = layer - first
            scales = None if kv_scales is None else (kv_scales[i, 0], kv_scales[i, 1])
            attn = self._attention(qkv, cos, sin, step, kv_pool[i, 0], kv_pool[i, 1], scales, p)
            # Under TP the row-parallel outputs are partial sums: rank 0 adds the residual (and the
            # biases), the others only their partials, and one all-reduce makes the sum everywhere.
            residual = x if self.is_reducing_rank else None
            if cfg.residual == "sequential":
                x = self._reduced(self._linear_add(attn, p + "out", residual, step.lora))  # x may be updated in place
                residual = x if self.is_reducing_rank else None
                x = self._reduced(self._mlp(self._norm(x, p + "post_norm"), p, residual, step.lora))
            else:  # parallel: both branches read the layer's input; one all-reduce for the two
                attn = self._linear(attn, p + "out", step.lora)
                mlp_input = h if cfg.residual == "parallel_shared_norm" else self._norm(x, p + "post_norm")
                x = self._reduced(self._mlp(mlp_input, p, attn if residual is None else residual + attn, step.lora))
        if not self.is_last_stage:
            return x, None
        logits = self._logits(x[step.logits_token_index])
        context_logits = None
        if step.context_logits_index is not None:
            context_logits = self._logits(x[step.context_logits_index])
        return logits, context_logits

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """int64 [T] -> [T, H]. Under TP a rank holds the rows of its vocabulary range: the others
        look up zeros, and an all-reduce sums them."""
        weight_format = self.embed_format
        if self.embed_rows_from_head:
            def rows(ids: torch.Tensor) -> torch.Tensor:
                return self.lm_head.rows(ids).to(self.dtype)
        elif self.embed_is_blocks:
            def rows(ids: torch.Tensor) -> torch.Tensor:
                return dequantize_rows(self.w, "embed_tokens", ids).to(self.dtype)
        elif weight_format is not None and self.embed_parts is None:   # read from the tied head's copy
            def rows(ids: torch.Tensor) -> torch.Tensor:
                return self.lm_head.rows(ids).to(self.dtype)
        elif weight_format is not None:
            def rows(ids: torch.Tensor) -> torch.Tensor:
                return weight_format.dequantize(*(part[ids] for part in self.embed_parts)).to(self.dtype)
        else:
            table = self.w["embed_tokens"]

            def rows(ids: torch.Tensor) -> torch.Tensor:
                return table[ids]
        if self.shard is None:
            return rows(input_ids)
        start, stop = self.shard.vocab_range
        local = input_ids - start
        outside = (local < 0) | (local >= stop - start)
        x = rows(local.clamp(0, max(stop - start - 1, 0))) if stop > start else \
            torch.zeros(input_ids.shape[0], self.config.hidden_size, dtype=self.dtype, device=self.device)
        x[outside] = 0
        return self.tp.all_reduce(x)

    def _reduced(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of a row-parallel output (itself without TP)."""
        return partial if self.tp is None else self.tp.all_reduce(partial)

    def _logits(self, x: torch.Tensor) -> torch.Tensor | None:
        """float32 [rows, V]; under TP each rank computes its vocabulary columns, gathered on every
        rank (gather_logits_to_all) or on rank 0 (the others get None)."""
        logits = self.kernels.linear(self._norm(x, "final_norm"), self.lm_head).float()
        if self.tp is None:
            return logits.contiguous()
        gathered = self.tp.gather_columns(logits, self.gather_logits_to_all)
        return gathered[:, :self.config.vocab_size].contiguous() if gathered is not None else None

    def _linear(self, x: torch.Tensor, prefix: str, lora: LoraStepPlan | None = None,
                row_start: int = 0) -> torch.Tensor:
        """x [T, in] -> [T, out] through the weight (and bias) stored under `prefix`, plus the
        LoRA products of the adapters of x's rows (tokens row_start.. of the step)."""
        y = self.kernels.linear(x, self.linears[prefix])
        if lora is not None:
            lora.apply(prefix, x, y, row_start)
        return y

    def _linear_add(self, x: torch.Tensor, prefix: str, residual: torch.Tensor | None,
                    lora: LoraStepPlan | None = None, row_start: int = 0) -> torch.Tensor:
        """residual + the linear of x (and its LoRA products); residual may be updated in place
        (one native pass where no adapter applies). residual None: the linear alone."""
        if residual is None:
            return self._linear(x, prefix, lora, row_start)
        if lora is None:
            return self.kernels.linear_add(x, self.linears[prefix], residual)
        return residual + self._linear(x, prefix, lora, row_start)

    def _mlp(self, h: torch.Tensor, p: str, residual: torch.Tensor | None,
             lora: LoraStepPlan | None = None) -> torch.Tensor:
        """residual + MLP(h), in row chunks of mlp_chunk_rows; residual may be updated in place
        (None: MLP(h) alone)."""
        rows = self.mlp_chunk_rows
        if rows is None or h.shape[0] <= rows:
            return self._linear_add(self._mlp_hidden(h, p, lora), p + "mlp_out", residual, lora)
        out = torch.empty_like(h)
        for start in range(0, h.shape[0], rows):
            out[start:start + rows] = self._linear(self._mlp_hidden(h[start:start + rows], p, lora, start),
                                                   p + "mlp_out", lora, start)
        return out if residual is None else residual + out

    def _mlp_hidden(self, h: torch.Tensor, p: str, lora: LoraStepPlan | None = None,
                    row_start: int = 0) -> torch.Tensor:
        up = self._linear(h, p + "mlp_in", lora, row_start)
        if self.config.mlp_type == "gated" and self.act is F.silu:
            return self.kernels.silu_mul(up)
        if self.config.mlp_type == "gated":
            gate, up = up.chunk(2, dim=-1)
            return self.act(gate).mul_(up)
        return self.act(up)

    def _qk_norm(self, qk: torch.Tensor, prefix: str) -> torch.Tensor:
        """[T, q heads + kv heads, head_dim] with every query head RMS-normalized by the layer's
        q_norm weight and every key head by its k_norm weight (Qwen3)."""
        num_tokens, _, head_dim = qk.shape
        num_q_heads, eps = self.local.num_heads, self.config.norm_eps
        q = self.kernels.rms_norm(qk[:, :num_q_heads].reshape(-1, head_dim), self.w[prefix + "q_norm.weight"], eps)
        k = self.kernels.rms_norm(qk[:, num_q_heads:].reshape(-1, head_dim), self.w[prefix + "k_norm.weight"], eps)
        return torch.cat((q.view(num_tokens, num_q_heads, head_dim), k.view(num_tokens, -1, head_dim)), dim=1)

    def _attention(self, qkv: torch.Tensor, cos, sin, step: StepLayout, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                   prefix: str = "") -> torch.Tensor:
        """qkv [T, q + 2 kv] -> attention output [T, q] (this rank's heads under TP). scales: the
        layer's (K, V) scales of a quantized cache; prefix: the layer's weight names' ("layers.{i}.")."""
        cfg, kernels = self.local, self.kernels
        num_tokens = qkv.shape[0]
        num_qk_heads = cfg.num_heads + cfg.num_kv_heads
        # Queries and keys rotate together: one rope pass instead of two (per-op overhead is a
        # visible share of a small generation step on CPU).
        qk = qkv[:, :cfg.q_size + cfg.kv_size].view(num_tokens, num_qk_heads, cfg.head_dim)
        if cfg.qk_norm:
            qk = self._qk_norm(qk, prefix)
        if cos is not None:
            qk = apply_rope(qk, cos, sin, cfg.rotary_style)
        q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
        v = qkv[:, cfg.q_size + cfg.kv_size:].view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        # Only a quantized cache passes scales: backends and test doubles without them keep working.
        quant = {} if scales is None else {"k_scales": scales[0], "v_scales": scales[1]}
        kernels.write_kv(k_cache, v_cache, k, v, step.slot_mapping, **quant)
        window, sink, slopes = self.attention_window, self.sink_token_length, self.alibi_slopes
        if not step.context_spans:  # generation only: token i is sequence i's one query
            out = kernels.decode_attention(q, k_cache, v_cache, step.generation_block_tables,
                                           step.generation_seq_lens, self.scale, window, sink, slopes, **quant)
            return out.reshape(num_tokens, cfg.q_size)
        out = torch.empty_like(q)
        if step.generation_seq_ids.numel():
            idx = step.generation_token_index
            out[idx] = kernels.decode_attention(q[idx], k_cache, v_cache, step.generation_block_tables,
                                                step.generation_seq_lens, self.scale, window, sink, slopes, **quant)
        for seq, start, n, past_len in step.context_spans:
            qs = q[start:start + n]
            if past_len == 0:  # NOTE: a fresh prompt attends to the keys just computed: no gather
                ks, vs = k[start:start + n], v[start:start + n]
                if scales is not None:   # NOTE: the keys as the cache holds them, as after a chunk or reuse
                    ks, vs = round_trip(ks, k_cache.dtype), round_trip(vs, v_cache.dtype)
                if qs.device.type == "cpu" or scales is not None:  # float32 math, as in the kernels
                    qs, ks, vs = qs.float(), ks.float(), vs.float()
                out[start:start + n] = kernels.dense_attention(qs, ks, vs, 0, self.scale, window,
                                                               sink, slopes).to(q.dtype)
            else:
                out[start:start + n] = kernels.context_attention(qs, k_cache, v_cache, step.block_tables[seq],
                                                                 past_len, self.scale, window, sink, slopes,
                                                                 **quant)
        return out.view(num_tokens, cfg.q_size)
