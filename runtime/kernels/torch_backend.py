"""The `torch` kernel backend: every operation of interface.KernelBackend in plain torch, bound
from the reference functions of torch_attention.py and torch_decoder.py (the oracle in tests).
With `fast_paths` (what get_kernels("torch") builds: the CPU default) decode and context
attention go through cpu_attention.py instead, with equal results.
"""
from __future__ import annotations

import torch

from . import torch_attention, torch_decoder
from .cpu_attention import CpuAttention


class TorchKernels:
    name = "torch"

    def __init__(self, fast_paths: bool = False):
        """fast_paths: decode and context attention through CpuAttention (length groups, per-thread
        workspaces, per-step plans); off, every op is the plain reference."""
        self._fast = CpuAttention() if fast_paths else None

    @property
    def has_fast_paths(self) -> bool:
        return self._fast is not None

    write_kv = staticmethod(torch_attention.write_kv)
    copy_blocks = staticmethod(torch_attention.copy_blocks)
    dense_attention = staticmethod(torch_attention.dense_attention)

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                         window: int | None, sink: int = 0, alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
        attend = torch_attention.decode_attention if self._fast is None else self._fast.decode_attention
        return attend(q, k_cache, v_cache, block_tables, seq_lens, scale, window, sink, alibi_slopes)

    def context_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_table: torch.Tensor, past_len: int, scale: float,
                          window: int | None, sink: int = 0, alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
        attend = torch_attention.context_attention if self._fast is None else self._fast.context_attention
        return attend(q, k_cache, v_cache, block_table, past_len, scale, window, sink, alibi_slopes)

    uniforms = staticmethod(torch_decoder.uniforms)
    apply_penalties = staticmethod(torch_decoder.apply_penalties)
    ban_tokens = staticmethod(torch_decoder.ban_tokens)
    repeat_ngram_bans = staticmethod(torch_decoder.repeat_ngram_bans)
    greedy = staticmethod(torch_decoder.greedy)
    log_softmax = staticmethod(torch_decoder.log_softmax)
    top_k_top_p_mask = staticmethod(torch_decoder.top_k_top_p_mask)
    sample = staticmethod(torch_decoder.sample)
    beam_candidates = staticmethod(torch_decoder.beam_candidates)
    apply_token_bitmask = staticmethod(torch_decoder.apply_token_bitmask)
    apply_min_p = staticmethod(torch_decoder.apply_min_p)
    top_log_probs = staticmethod(torch_decoder.top_log_probs)
