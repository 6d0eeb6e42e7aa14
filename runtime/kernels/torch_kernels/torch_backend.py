"""The `torch` kernel backend: every operation of interface.KernelBackend in plain torch, bound
from the reference functions of torch_attention.py, torch_decoder.py and torch_dense.py (the
oracle in tests). With `fast_paths` (what get_kernels("torch") builds: the CPU default) decode and
context attention go through cpu_attention.py instead, with equal results; with `native` too
(also the default), float32 decode and context attention run in the native kernels of cpu_native.py
where they can.

The dense ops take their CPU fast paths whatever those flags say, as the model always did:
matmul weights prepared by linear.py (oneDNN, BLAS or the native few-row kernels),
weight_only_linear.py and block_linear.py (llama.cpp's block formats), RMSNorm and silu * up in
the native kernels (float32, bf16) where they run.
BATCH_MANAGER_CPU_NATIVE=0 turns the native ones off, read when a model prepares its weights.
"""
from __future__ import annotations

import torch

from . import torch_attention, torch_decoder, torch_dense
from .cpu_attention import CpuAttention
from ..cpu.cpu_decode_step import DecodeStep
from ..cpu.cpu_native import native_ops
from ..cpu.cpu_native_bf16 import bf16_ops
from ..interface import NO_TOKEN, PreparedLinear
from .linear import Linear
from .block_linear import BlockLinear
from .weight_only_linear import QuantizedLinear


class TorchKernels:
    name = "torch"
    kv_storage_dtypes = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.float8_e4m3fn})

    def __init__(self, fast_paths: bool = False, native: bool = False):
        """fast_paths: decode and context attention through CpuAttention (length groups, per-thread
        workspaces, per-step plans); off, every attention and decoding op is the plain reference
        (the dense ops take their fast paths either way). native (with fast_paths): float32 decode
        attention in the native CPU kernel where it runs."""
        self.cpu_attention = CpuAttention(use_native=native) if fast_paths else None
        self._native = native_ops() if fast_paths and native else None   # None where it cannot run
        # dtype -> the native RMSNorm and silu * up kernels that run here (float32, bf16); None until
        # the first dense op on a CPU tensor (a model's prepare_* at its construction) captures them.
        self._dense_native: dict[torch.dtype, object] | None = None

    write_kv = staticmethod(torch_attention.write_kv)
    copy_blocks = staticmethod(torch_attention.copy_blocks)

    def dense_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past_len: int, scale: float,
                        window: int | None, sink: int = 0, alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
        attend = (self.cpu_attention or torch_attention).dense_attention
        return attend(q, k, v, past_len, scale, window, sink, alibi_slopes)

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                         window: int | None, sink: int = 0, alibi_slopes: torch.Tensor | None = None,
                         k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None) -> torch.Tensor:
        attend = (self.cpu_attention or torch_attention).decode_attention
        return attend(q, k_cache, v_cache, block_tables, seq_lens, scale, window, sink, alibi_slopes,
                      k_scales, v_scales)

    def context_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_table: torch.Tensor, past_len: int, scale: float,
                          window: int | None, sink: int = 0, alibi_slopes: torch.Tensor | None = None,
                          k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None) -> torch.Tensor:
        attend = (self.cpu_attention or torch_attention).context_attention
        return attend(q, k_cache, v_cache, block_table, past_len, scale, window, sink, alibi_slopes,
                      k_scales, v_scales)

    def prepare_linear(self, weight: torch.Tensor, bias: torch.Tensor | None, impl: str | None = None
                       ) -> PreparedLinear:
        if weight.is_cpu:
            self.native_dense_ops()   # captured with the weights' own kernels, when the model is built
        return Linear(weight, bias, weight.device, impl)

    def prepare_weight_only_linear(self, weight: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None,
                                   bias: torch.Tensor | None, act_quant: str | None = None) -> PreparedLinear:
        if weight.is_cpu:
            self.native_dense_ops()   # captured with the weights' own kernels, when the model is built
        return QuantizedLinear(weight, scale, minimum, bias, act_quant)

    def prepare_block_linear(self, segments, bias: torch.Tensor | None) -> PreparedLinear:
        if segments[0][1].is_cpu:
            self.native_dense_ops()   # captured with the weights' own kernels, when the model is built
        return BlockLinear(segments, bias)

    def prepare_decode_step(self, model, kv_pool: torch.Tensor, kv_scales: torch.Tensor | None,
                            tokens_per_block: int):
        """The native fused generation step (cpu_decode_step.py) where it covers the model, else None."""
        return DecodeStep.build(model, kv_pool, kv_scales, tokens_per_block)

    def linear(self, x: torch.Tensor, weight: PreparedLinear) -> torch.Tensor:
        return weight(x)

    def linear_add(self, x: torch.Tensor, weight: PreparedLinear, residual: torch.Tensor) -> torch.Tensor:
        return weight.add_to(x, residual)

    # NOTE: RMSNorm and silu * up are one native call each on CPU (F.rms_norm is ~6 ops: 50 us for
    # one row of 512); the bf16 kernels sum in float32.
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.is_cpu and x.dim() == 2 and x.stride(1) == 1:
            native = self.native_dense_ops().get(x.dtype)
            if native is not None:
                return native.rms_norm(x, weight, eps)
        return torch_dense.rms_norm(x, weight, eps)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cpu and x.dim() == 2 and x.stride(1) == 1:
            native = self.native_dense_ops().get(x.dtype)
            if native is not None:
                return native.silu_mul(x)
        return torch_dense.silu_mul(x)

    def native_dense_ops(self) -> dict[torch.dtype, object]:
        if self._dense_native is None:
            found = {torch.float32: native_ops(), torch.bfloat16: bf16_ops()}
            self._dense_native = {dtype: ops for dtype, ops in found.items() if ops is not None}
        return self._dense_native

    uniforms = staticmethod(torch_decoder.uniforms)
    apply_penalties = staticmethod(torch_decoder.apply_penalties)
    ban_tokens = staticmethod(torch_decoder.ban_tokens)
    repeat_ngram_bans = staticmethod(torch_decoder.repeat_ngram_bans)

    def greedy(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if (self._native is not None and logits.device.type == "cpu" and logits.dtype == torch.float32
                and logits.dim() == 2 and logits.stride(1) == 1):
            return self._native.greedy(logits, NO_TOKEN)   # two passes over a row instead of ~6 torch ops
        return torch_decoder.greedy(logits)

    log_softmax = staticmethod(torch_decoder.log_softmax)
    top_k_top_p_mask = staticmethod(torch_decoder.top_k_top_p_mask)
    sample = staticmethod(torch_decoder.sample)
    beam_candidates = staticmethod(torch_decoder.beam_candidates)
    def apply_token_bitmask(self, logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
        if (self._native is not None and logits.device.type == "cpu" and logits.dtype == torch.float32
                and logits.stride(1) == 1):
            return self._native.apply_token_bitmask(logits, rows, bitmask)   # one pass, bits read in place
        return torch_decoder.apply_token_bitmask(logits, rows, bitmask)
    apply_min_p = staticmethod(torch_decoder.apply_min_p)
    top_log_probs = staticmethod(torch_decoder.top_log_probs)
