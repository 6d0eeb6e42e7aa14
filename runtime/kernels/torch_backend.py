"""The `torch` kernel backend: every operation of interface.KernelBackend in plain torch, bound
from the reference functions of torch_attention.py and torch_decoder.py (the oracle in tests).
With `fast_paths` (what get_kernels("torch") builds: the CPU default) decode and context
attention go through cpu_attention.py instead, with equal results; with `native` too (also the
default), float32 decode attention runs in the native kernel of cpu_native.py where it can.
"""
from __future__ import annotations

import torch

from . import torch_attention, torch_decoder
from .cpu_attention import CpuAttention
from .cpu_native import native_ops


class TorchKernels:
    name = "torch"

    def __init__(self, fast_paths: bool = False, native: bool = False):
        """fast_paths: decode and context attention through CpuAttention (length groups, per-thread
        workspaces, per-step plans); off, every op is the plain reference. native (with
        fast_paths): float32 decode attention in the native CPU kernel where it runs."""
        self._fast = CpuAttention(use_native=native) if fast_paths else None
        self._native = native_ops() if fast_paths and native else None   # None where it cannot run

    @property
    def has_fast_paths(self) -> bool:
        return self._fast is not None

    write_kv = staticmethod(torch_attention.write_kv)
    copy_blocks = staticmethod(torch_attention.copy_blocks)
    dense_attention = staticmethod(torch_attention.dense_attention)

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                         window: int | None, sink: int = 0, alibi_slopes: torch.Tensor | None = None,
                         k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None) -> torch.Tensor:
        attend = torch_attention.decode_attention if self._fast is None else self._fast.decode_attention
        return attend(q, k_cache, v_cache, block_tables, seq_lens, scale, window, sink, alibi_slopes,
                      k_scales, v_scales)

    def context_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_table: torch.Tensor, past_len: int, scale: float,
                          window: int | None, sink: int = 0, alibi_slopes: torch.Tensor | None = None,
                          k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None) -> torch.Tensor:
        attend = torch_attention.context_attention if self._fast is None else self._fast.context_attention
        return attend(q, k_cache, v_cache, block_table, past_len, scale, window, sink, alibi_slopes,
                      k_scales, v_scales)

    uniforms = staticmethod(torch_decoder.uniforms)
    apply_penalties = staticmethod(torch_decoder.apply_penalties)
    ban_tokens = staticmethod(torch_decoder.ban_tokens)
    repeat_ngram_bans = staticmethod(torch_decoder.repeat_ngram_bans)
    greedy = staticmethod(torch_decoder.greedy)
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
