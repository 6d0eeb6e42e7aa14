"""The kernel-backend interface: every operation the model, the model runner and the decoder call,
with its shapes, dtypes and semantics. Backends (torch_backend, cuda_backend, emu_backend) each
implement all of it; tests/runtime/kernels/test_interface.py checks that.

KV layouts shared by every backend:
  k_cache, v_cache: [num_blocks, tokens_per_block, num_kv_heads, head_dim] (one layer)
  block_tables:     int32 [num_seqs, max_blocks_per_seq]; entry j holds the block of tokens
                    [j * tokens_per_block, (j + 1) * tokens_per_block); unused entries are ignored
  window:           None or w > 0; a query at position p sees keys at positions (p - w, p]
  sink:             s >= 0 sink tokens (StreamingLLM): keys at positions < s stay visible to every
                    later query even outside the window (only meaningful with a window)
  alibi_slopes:     None or float32 [H] (the query heads): the score of query head h at position p
                    for the key at position k gains slope_h * (k - p) (ALiBi, runtime/models/alibi.py);
                    positions are the absolute cache positions, whatever the window
  A block-table entry whose block holds no key visible to any query of the call may be negative
  (its block was released); kernels never read such blocks.
Decoding ops are row-wise: a row's result depends on that row's inputs only (batch invariance).
Logits are float32 [R, V]; `rows` int64 [n] selects the rows an in-place op touches; per-row
parameters are [n]. Semantics follow TensorRT-LLM's (torch_decoder.py has the definitions).
A token whose logit is -inf is never chosen: a row with no allowed token (every logit -inf, as
when a guide's mask and the bans leave nothing) yields NO_TOKEN, which the decoder reports.
Dense ops (linear, norms, the gated MLP's product) take activations [rows, features] in the
compute dtype on the model's device; a matmul weight is prepared once at load (prepare_*) and the
prepared object is what `linear` / `linear_add` take.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

NO_TOKEN = -1   # greedy / sample of a row with no allowed token (log prob -inf)


class PreparedLinear(Protocol):
    """A matmul weight as one backend prepared it: opaque to callers, who pass it back to that
    backend's linear / linear_add, but for `weight`."""
    weight: torch.Tensor   # the tensor it holds, in whatever layout the backend chose (what memory
                           # accounting counts; the original when the backend kept it as given)
    # A weight-only one also has `parts` (its format's parts as held, in the format's order: they
    # replace the stored ones) and `rows(ids int64 [T]) -> float32 [T, in]` (a tied table's lookup).


@runtime_checkable
class KernelBackend(Protocol):
    name: str  # "torch" | "cuda" | "emu"
    # The KV pool element dtypes its write_kv / attention kernels run (kv_quant.check_kv_storage).
    kv_storage_dtypes: frozenset[torch.dtype]

    # ---- KV cache and attention (runtime/models/transformer.py, runtime/model_runner.py) -------------------------
    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scales: torch.Tensor | None = None,
                 v_scales: torch.Tensor | None = None) -> None:
        """k, v [T, kv_heads, head_dim] (any float dtype; stored as the cache's) -> the cache slots
        slot_mapping int64 [T] (block * tokens_per_block + offset), in place. With k_scales,
        v_scales (float32 [num_blocks, tokens_per_block, kv_heads]) the caches are quantized (int8,
        or fp8 e4m3 on the torch backend): each (token, head) row is stored as kv_quant.py defines,
        its scale in the same slot of the scales. The attention ops below take the same scales
        and read such a cache as q * scale, accumulating in float32."""

    def copy_blocks(self, kv_pool: torch.Tensor, src_block_ids: torch.Tensor, dst_block_ids: torch.Tensor) -> None:
        """kv_pool [num_layers, 2, num_blocks, tokens_per_block, kv_heads, head_dim]: block
        src[i] -> block dst[i] (int64 [m] each) in every layer, K and V, in place. Destinations are
        distinct and none is also a source (copy-on-write into fresh blocks): pairs may run at once.
        Any storage dtype, and the scale pools [num_layers, 2, num_blocks, tokens_per_block, kv_heads]."""

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                         window: int | None, sink: int = 0, alibi_slopes: torch.Tensor | None = None,
                         k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None) -> torch.Tensor:
        """Paged attention of one query per sequence, at position seq_lens - 1. q [B, H, D] (the
        cache's dtype; the compute dtype with a quantized cache) -> [B, H, D]; H is a multiple of kv_heads (GQA/MQA). seq_lens int [B]
        counts the cached tokens including the query's own (already written); block_tables
        int32 [B, max_blocks]. softmax(scale * q.k (+ the ALiBi bias)) over the visible keys, times v."""

    def context_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_table: torch.Tensor, past_len: int, scale: float,
                          window: int | None, sink: int = 0, alibi_slopes: torch.Tensor | None = None,
                          k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None
                          ) -> torch.Tensor:
        """One sequence's queries at positions past_len .. past_len + n - 1, whose keys (the n new
        ones included) are in the cache: q [n, H, D] -> [n, H, D]; block_table int32 [max_blocks].
        Causal (bottom-right aligned), limited by window and sink."""

    def dense_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past_len: int, scale: float,
                        window: int | None, sink: int = 0, alibi_slopes: torch.Tensor | None = None
                        ) -> torch.Tensor:
        """Attention over keys already at hand: q [n, H, D] at positions past_len .., k, v
        [past_len + n, kv_heads, D] -> [n, H, D] in q's dtype (the caller picks the math dtype).
        A fresh prompt attends to its just-computed keys through this, without a gather."""

    # ---- dense math (runtime/models/transformer.py) ------------------------------------------------------------
    def prepare_linear(self, weight: torch.Tensor, bias: torch.Tensor | None, impl: str | None = None
                       ) -> PreparedLinear:
        """weight [out, in] and bias [out] or None, in the compute dtype on the model's device ->
        the weight ready for linear / linear_add (a CPU backend may reorder it for its GEMM: the
        result's .weight then replaces the original). impl forces a CPU matmul kernel (one of
        runtime.kernels.torch_kernels.linear.CPU_IMPLS; None: the fastest available); ignored off the CPU."""

    def prepare_weight_only_linear(self, weight: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None,
                                   bias: torch.Tensor | None, act_quant: str | None = None) -> PreparedLinear:
        """A weight-only quantized weight ready for linear / linear_add: W and its format's parts
        (runtime.quantization, the format named by W's dtype: int8 W with scale and minimum None,
        packed int4 W with scale and minimum); bias [out] (the compute dtype) or None. .weight is `weight`,
        or what replaces it (a CPU backend's repacked layout for act_quant: one copy held).
        act_quant "int8": the activations are quantized per block of 32 columns and the products
        are integer (runtime/kernels/cpu/act_quant.py defines the arithmetic); None: exact."""

    def prepare_block_linear(self, segments, bias: torch.Tensor | None) -> PreparedLinear:
        """A weight kept in llama.cpp's block formats ready for linear / linear_add: `segments`, a
        sequence of (runtime.quantization.gguf_blocks.BlockFormat, uint8 [rows_i, row_bytes_i]) whose
        rows are the output rows in order, each segment in its own format, all of one input width
        (runtime.quantization.block_weights); bias [out] (the compute dtype) or None. .weight is the
        first segment's tensor."""

    def prepare_decode_step(self, model, kv_pool: torch.Tensor, kv_scales: torch.Tensor | None,
                            tokens_per_block: int):
        """The whole generation step of `model` (runtime.models.transformer.Transformer) over its
        KV pool as one call, or None where this backend has none for it (the model then runs
        op by op). The callable takes (input_ids, positions, slots, seq_lens int64 [rows],
        block_tables int32 [rows, width]) of sequences with one new token each, checked by the
        caller, writes their K / V and returns float32 logits [rows, V]; it takes at most
        `max_rows` rows (its attribute)."""

    def linear(self, x: torch.Tensor, weight: PreparedLinear) -> torch.Tensor:
        """x [rows, in] (any strides) -> x @ W^T + bias [rows, out] in x's dtype, W the prepared
        weight (de-quantized for a weight-only one). The result is a new tensor, possibly strided
        (a transposed view of [out, rows]); the caller may write into it."""

    def linear_add(self, x: torch.Tensor, weight: PreparedLinear, residual: torch.Tensor) -> torch.Tensor:
        """residual [rows, out] + linear(x, weight): the sum, accumulated into residual where the
        backend can (one pass, no temporary; the result is then residual itself), else a new
        tensor. Callers use the result and treat residual as consumed."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [rows, h] and weight [h] of one dtype -> x * rsqrt(mean(x^2) + eps) * weight, a new
        tensor in x's dtype; half precision is normalised in float32 and rounded before the weight
        multiplies (the Hugging Face reference)."""

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, 2n] (gate | up) -> silu(gate) * up [rows, n] in x's dtype, a new tensor: the
        gated MLP's hidden activation."""

    # ---- decoding (runtime/decoding/decoder.py) -----------------------------------------------------------
    def uniforms(self, seeds: torch.Tensor, steps: torch.Tensor, beams: torch.Tensor) -> torch.Tensor:
        """float32 [R] in [0, 1) on seeds' device: the Philox draw (runtime/rng.py) keyed by each
        (seed: uint64 bits in int64 [R], step int64 [R], beam int64 [R]); bit-identical everywhere."""

    def apply_penalties(self, logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor,
                        token_lengths: torch.Tensor, embedding_bias: torch.Tensor | None,
                        temperature: torch.Tensor, repetition_penalty: torch.Tensor,
                        presence_penalty: torch.Tensor, frequency_penalty: torch.Tensor,
                        min_lengths: torch.Tensor, num_generated: torch.Tensor, end_ids: torch.Tensor) -> None:
        """In place on logits[rows], in this order: + embedding_bias (float32 [n, V] or None),
        / temperature (> 0), then the repetition (divide positive / multiply negative logits),
        presence (- p once) and frequency (- f * count) penalties of the tokens in token_ids
        int64 [n, L] (prompt + generated, padded; the first token_lengths [n] count), then the
        end id end_ids [n] (-1: none) is banned (-inf) while num_generated < min_lengths."""

    def ban_tokens(self, logits: torch.Tensor, row_ids: torch.Tensor, token_ids: torch.Tensor) -> None:
        """logits[row_ids[i], token_ids[i]] = -inf for every pair i (int64 [m] each), in place."""

    def repeat_ngram_bans(self, tokens: torch.Tensor, ngram_size: int) -> torch.Tensor:
        """tokens int64 [L] (one sequence, on the host) -> int64 [k]: the distinct token ids that
        would complete an n-gram already present in it (n = ngram_size; none when n <= 0 or L < n)."""

    def greedy(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (tokens int64 [R]: the first maximum of each row, log_probs float32 [R]: its log
        softmax over the whole vocabulary). A row whose every logit is -inf (or NaN): NO_TOKEN, -inf."""

    def log_softmax(self, logits: torch.Tensor) -> torch.Tensor:
        """float32 [R, V]: log softmax of each row."""

    def top_k_top_p_mask(self, logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        """bool [R, V]: the tokens sampling may draw. top_k int64 [R] (0: off) keeps exactly k
        tokens, ties at the k-th place to the lower id; top_p float32 [R] (<= 0 or >= 1: off)
        then keeps the smallest prefix (by probability, ties by id) whose mass, renormalised over
        the top-k tokens, reaches p (Hugging Face's warpers)."""

    def sample(self, logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor,
               normalize_log_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits float32 [R, V] (processed), top_k int64 [R], top_p float32 [R], uniforms float32
        [R] in [0, 1), normalize_log_probs bool [R] -> (tokens int64 [R], log_probs float32 [R]).
        The draw: the first token, in id order, whose cumulative weight exp(logit - max) over the
        top_k_top_p_mask tokens exceeds u * total. The log prob is under that renormalised
        distribution where normalize_log_probs is set, else over the whole vocabulary. A row whose
        every logit is -inf (or NaN) draws nothing: NO_TOKEN, log prob -inf."""

    def apply_token_bitmask(self, logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
        """Guided decoding, in place: in logits[rows] (rows int64 [n]) -inf for every token v whose
        bit (v % 32) of bitmask[i, v // 32] (int32 [n, >= ceil(V / 32)], llguidance's layout) is clear."""

    def apply_min_p(self, logits: torch.Tensor, rows: torch.Tensor, min_p: torch.Tensor) -> None:
        """min-p, in place: in logits[rows], -inf where exp(x - row max) < min_p[i] (float32 [n]);
        the top token always stays."""

    def top_log_probs(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (values float32 [R, k], ids int64 [R, k]): each row's k largest log-softmax values,
        descending, ties to the lower id (1 <= k <= V)."""

    def beam_candidates(self, log_probs: torch.Tensor, running_scores: torch.Tensor, num_candidates: int,
                        diversity_rate: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One request's beam step: log_probs float32 [num_beams, V] (processed, log-softmaxed),
        running_scores float32 [num_beams] -> the C = min(num_candidates, num_beams * V) best
        continuations, best first: (cumulative scores float32 [C], parent beams int64 [C], tokens
        int64 [C]). With a diversity rate d, the r-th best continuation of each beam ranks by
        score - d * r (its cumulative score is unchanged)."""


KERNEL_OPS = tuple(name for name in vars(KernelBackend)
                   if not name.startswith("_") and callable(vars(KernelBackend)[name]))
