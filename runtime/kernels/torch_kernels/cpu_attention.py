"""CPU fast paths of decode and context attention, owned by the `torch` backend that runners get
(TorchKernels(fast_paths=True)): float32 and bf16 decode attention in the native kernels
(cpu_native.py, cpu_native_bf16.py) where they run, reading the cached blocks in place; otherwise
decode rows grouped by length, gathers into per-thread reusable workspaces, and a decode plan per
step reused by every layer. A quantized cache (int8 / fp8 with float32 scales, kv_quant.py) is
gathered as stored and de-quantized in float32; int8 decode attention runs natively too. Every
result equals the plain reference of torch_attention.py, which stays the definition.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..cpu.cpu_native import native_ops
from ..cpu.cpu_native_bf16 import bf16_ops
from ..kv_quant import dequantize
from .torch_attention import alibi_mask, block_ids, compute_dtype, dense_attention, visible

# Fixed cost of one more attention call (gather K, gather V, SDPA), in block-rows: the work of
# gathering and attending one block of one sequence. Estimated from a CPU profile (default model,
# batch 34, up to 384 keys): ~17 us per block-row per layer; ~0.1 ms per call assumed for the
# three extra ops. The A/B against one padded call: 1.11-1.15x at batch 34-64.
GROUP_COST_BLOCK_ROWS = 8


def length_groups(seq_lens: list[int], tokens_per_block: int) -> list[list[int]]:
    """Rows of a decode batch split into groups padded to their own longest sequence.

    A single padded call gathers and attends rows x max blocks; grouping rows of similar length
    saves the padding at the price of a call per group. Groups are contiguous runs of the rows
    sorted by block count, chosen by dynamic programming to minimise padded block-rows plus
    GROUP_COST_BLOCK_ROWS per group. Row order within a group is ascending by block count."""
    blocks = [-(-n // tokens_per_block) for n in seq_lens]
    counts = sorted(set(blocks))
    if len(counts) == 1:
        return [list(range(len(seq_lens)))]
    rows_with = {c: 0 for c in counts}
    for b in blocks:
        rows_with[b] += 1
    # best[j]: minimal cost of grouping the rows whose block count is among counts[:j]
    best, cut = [0.0] + [float("inf")] * len(counts), [0] * (len(counts) + 1)
    for j in range(1, len(counts) + 1):
        rows = 0
        for i in range(j, 0, -1):  # last group = counts[i-1 .. j-1], padded to counts[j-1]
            rows += rows_with[counts[i - 1]]
            cost = best[i - 1] + rows * counts[j - 1] + GROUP_COST_BLOCK_ROWS
            if cost < best[j]:
                best[j], cut[j] = cost, i - 1
    bounds, j = [], len(counts)
    while j > 0:
        bounds.append((counts[cut[j]], counts[j - 1]))
        j = cut[j]
    order = sorted(range(len(seq_lens)), key=blocks.__getitem__)
    return [[r for r in order if low <= blocks[r] <= high] for low, high in reversed(bounds)]


@dataclass
class _DecodeGroup:
    """Rows of a decode call attended together, padded to their longest sequence."""
    rows: torch.Tensor | None  # int64 [n]: their rows in the batch (None: all rows, in order)
    block_ids: torch.Tensor    # int64 [n * nb]: the blocks to gather
    num_rows: int
    num_tokens: int            # keys gathered per row
    mask: torch.Tensor         # bool [n, 1, 1, num_tokens]: the keys each row's query sees; with ALiBi
                               # additive, float32 [n, H, 1, num_tokens] (-inf where hidden)


class CpuAttention:
    """Decode and context attention with per-thread state: gather workspaces and the last plan."""

    def __init__(self, use_native: bool = False):
        """use_native: float32 decode and context attention through the native kernels when they
        can run here."""
        self._threads = threading.local()
        self.native = native_ops() if use_native else None
        self._native_bf16 = bf16_ops() if use_native else None   # bf16 queries over a bf16 cache

    def thread_state(self) -> dict:
        return self._threads.__dict__

    def _workspace(self, slot: int, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat buffer of at least `numel` elements, owned by the calling thread, grown on demand.

        NOTE: the gathered keys and values of a decode step are several MB per layer; allocated
        afresh each layer they come from mmap under glibc's default malloc and page-fault on every
        write: a batch-34 step with 40-384 cached tokens took 135 ms against 54 ms with reuse."""
        buffers = self.thread_state()
        key = ("workspace", slot, dtype, device)
        buffer = buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = buffers[key] = torch.empty(max(numel, 2 * (0 if buffer is None else buffer.numel())),
                                                dtype=dtype, device=device)
        return buffer[:numel]

    def gather_kv(self, cache: torch.Tensor, block_tables: torch.Tensor, num_tokens: int,
                  workspace_slot: int) -> torch.Tensor:
        """torch_attention.gather_kv into this thread's buffer of `workspace_slot`: valid only until
        the next gather into the same slot."""
        return self._gather(cache, block_ids(block_tables, num_tokens, cache.shape[1]), block_tables.shape[0],
                            num_tokens, workspace_slot)

    def _gather(self, cache: torch.Tensor, ids: torch.Tensor, num_rows: int, num_tokens: int,
                workspace_slot: int) -> torch.Tensor:
        shape = (ids.numel(), *cache.shape[1:])
        out = self._workspace(workspace_slot, math.prod(shape), cache.dtype, cache.device).view(shape)
        blocks = torch.index_select(cache, 0, ids, out=out)  # [B * nb, tpb, kvH, D]
        return blocks.view(num_rows, -1, *cache.shape[2:])[:, :num_tokens]

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                         window: int | None, sink: int = 0, alibi_slopes: torch.Tensor | None = None,
                         k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None) -> torch.Tensor:
        """torch_attention.decode_attention: natively for float32 CPU caches, float32 queries over
        int8 caches and bf16 queries over bf16 caches (without ALiBi), else one call per length
        group of the step's plan."""
        if (self.native is not None and alibi_slopes is None and q.dtype == torch.float32
                and q.device.type == "cpu" and k_cache.is_contiguous() and v_cache.is_contiguous()):
            if k_scales is None and k_cache.dtype == torch.float32:
                return self.native.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, window, sink)
            if k_scales is not None and k_cache.dtype == torch.int8:
                return self.native.decode_attention_int8(q, k_cache, v_cache, k_scales, v_scales, block_tables,
                                                          seq_lens, scale, window, sink)
        if (self._native_bf16 is not None and alibi_slopes is None and k_scales is None
                and q.dtype == k_cache.dtype == v_cache.dtype == torch.bfloat16 and q.device.type == "cpu"
                and k_cache.is_contiguous() and v_cache.is_contiguous()):
            return self._native_bf16.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, window,
                                                      sink)
        plan = self._decode_plan(block_tables, seq_lens, k_cache.shape[1], window, sink, alibi_slopes, q.device)
        scales = None if k_scales is None else (k_scales, v_scales)
        if len(plan) == 1:
            return self._decode_rows(q, k_cache, v_cache, plan[0], scale, scales)
        out = torch.empty_like(q)
        for group in plan:
            out[group.rows] = self._decode_rows(q[group.rows], k_cache, v_cache, group, scale, scales)
        return out

    def _decode_plan(self, block_tables: torch.Tensor, seq_lens: torch.Tensor, tokens_per_block: int,
                     window: int | None, sink: int, alibi_slopes: torch.Tensor | None,
                     device: torch.device) -> list[_DecodeGroup]:
        """The row groups, block ids and masks of a decode call. Every layer of a step asks for the
        same plan, so the thread's last one is reused while its inputs are equal."""
        lens = seq_lens.tolist()
        slopes = None if alibi_slopes is None else alibi_slopes.tolist()
        key = (lens, tokens_per_block, window, sink, slopes, device)
        state = self.thread_state()
        memo = state.get("decode_plan")
        if (memo is not None and memo[0] == key and memo[1].shape == block_tables.shape
                and torch.equal(memo[1], block_tables)):
            return memo[2]
        groups = length_groups(lens, tokens_per_block)
        if len(groups) == 1:  # one padded call over the rows as they come
            groups = [list(range(len(lens)))]
        plan = []
        for rows in groups:
            index = None if len(groups) == 1 else torch.tensor(rows, device=device)
            tables = block_tables if index is None else block_tables[index]
            num_tokens = max(lens[r] for r in rows)
            query_pos = torch.tensor([lens[r] - 1 for r in rows], device=device)[:, None]  # [n, 1]
            key_pos = torch.arange(num_tokens, device=device)
            mask = visible(query_pos, key_pos, window, sink)  # [n, 1, L]
            mask = (mask[:, None] if alibi_slopes is None
                    else alibi_mask(mask, query_pos, key_pos, alibi_slopes, torch.float32))  # [n, 1 | H, 1, L]
            plan.append(_DecodeGroup(index, block_ids(tables, num_tokens, tokens_per_block), len(rows),
                                     num_tokens, mask))
        state["decode_plan"] = (key, block_tables.clone(), plan)
        return plan

    def _decode_rows(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: _DecodeGroup,
                     scale: float, scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """decode_attention over one group's rows, padded to their longest sequence; `scales`: the
        (K, V) scales of a quantized cache."""
        dtype = compute_dtype(q) if scales is None else torch.float32
        # [n, kvH, L, D] views of the gathered keys and values (SDPA takes the strides as they are)
        k = self._gather(k_cache, group.block_ids, group.num_rows, group.num_tokens, 0)
        v = self._gather(v_cache, group.block_ids, group.num_rows, group.num_tokens, 1)
        if scales is not None:
            k = dequantize(k, self._gather(scales[0], group.block_ids, group.num_rows, group.num_tokens, 2))
            v = dequantize(v, self._gather(scales[1], group.block_ids, group.num_rows, group.num_tokens, 3))
        k, v = k.to(dtype).transpose(1, 2), v.to(dtype).transpose(1, 2)
        mask = group.mask if group.mask.dtype == torch.bool else group.mask.to(dtype)
        out = F.scaled_dot_product_attention(q.to(dtype)[:, :, None, :], k, v, attn_mask=mask, scale=scale,
                                             enable_gqa=True)  # [n, H, 1, D]
        return out[:, :, 0].to(q.dtype)

    def context_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_table: torch.Tensor, past_len: int, scale: float,
                          window: int | None, sink: int = 0, alibi_slopes: torch.Tensor | None = None,
                          k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None) -> torch.Tensor:
        """torch_attention.context_attention with the keys and values gathered into workspaces."""
        total = past_len + q.shape[0]
        dtype = compute_dtype(q) if k_scales is None else torch.float32
        k = self.gather_kv(k_cache, block_table[None], total, workspace_slot=0)[0]  # [total, kvH, D]
        v = self.gather_kv(v_cache, block_table[None], total, workspace_slot=1)[0]
        if k_scales is not None:
            k = dequantize(k, self.gather_kv(k_scales, block_table[None], total, workspace_slot=2)[0])
            v = dequantize(v, self.gather_kv(v_scales, block_table[None], total, workspace_slot=3)[0])
        k, v = k.to(dtype), v.to(dtype)
        return self.dense_attention(q.to(dtype), k, v, past_len, scale, window, sink, alibi_slopes).to(q.dtype)

    def dense_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past_len: int, scale: float,
                        window: int | None, sink: int = 0, alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
        """torch_attention.dense_attention: natively for float32 CPU tensors without window or ALiBi
        (head_dim a multiple of 16, head rows contiguous: views into a fused qkv row qualify), else
        the reference's SDPA. Native against SDPA, SmolLM2's 512-token prompt (9 / 3 heads of 64),
        2 threads of an AMD EPYC Zen 3: 4.5 against 9.5 ms a layer."""
        if (self.native is not None and window is None and alibi_slopes is None and q.device.type == "cpu"
                and q.dtype == k.dtype == v.dtype == torch.float32 and q.shape[-1] % 16 == 0
                and k.shape[0] == past_len + q.shape[0]
                and all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (q, k, v))):
            return self.native.dense_attention(q, k, v, scale)
        return dense_attention(q, k, v, past_len, scale, window, sink, alibi_slopes)
