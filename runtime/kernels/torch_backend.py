"""Torch reference of the KV-cache and attention kernels (the oracle for the CUDA versions).

Layouts shared with every backend:
  k_cache, v_cache: [num_blocks, tokens_per_block, num_kv_heads, head_dim] (one layer)
  block_tables:     int32 [num_seqs, max_blocks_per_seq]; entry j holds the block of tokens
                    [j * tokens_per_block, (j + 1) * tokens_per_block); unused entries are ignored
  window:           None or w > 0; query at position p sees keys at positions (p - w, p]
  sink:             s >= 0 sink tokens (StreamingLLM): keys at positions < s stay visible to every
                    later query even outside the window (only meaningful with a window)
  A block-table entry whose block holds no key visible to any query of the call may be negative
  (its block was released); kernels never read such blocks.
Attention math runs in float32 on CPU (fp16/bf16 storage is upcast), in the storage dtype on GPU.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .torch_decoder import TorchDecoderKernels


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float32 if t.device.type == "cpu" else t.dtype


def _visible(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None, sink: int = 0) -> torch.Tensor:
    """bool mask [..., num_queries, num_keys]: causal, limited to the window (plus the sink
    tokens) when one is set."""
    mask = key_pos[..., None, :] <= query_pos[..., :, None]
    if window is not None:
        in_window = key_pos[..., None, :] > query_pos[..., :, None] - window
        mask &= in_window | (key_pos[..., None, :] < sink)
    return mask


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


def _block_ids(block_tables: torch.Tensor, num_tokens: int, tokens_per_block: int) -> torch.Tensor:
    """int64 [B * nb]: the blocks holding each row's first num_tokens tokens, row-major.
    Released blocks (negative ids) hold only invisible keys: block 0 is read in their place."""
    num_blocks = -(-num_tokens // tokens_per_block)
    return block_tables[:, :num_blocks].long().clamp(min=0).flatten()


@dataclass
class _DecodeGroup:
    """Rows of a decode call attended together, padded to their longest sequence."""
    rows: torch.Tensor | None  # int64 [n]: their rows in the batch (None: all rows, in order)
    block_ids: torch.Tensor    # int64 [n * nb]: the blocks to gather
    num_rows: int
    num_tokens: int            # keys gathered per row
    mask: torch.Tensor         # bool [n, 1, 1, num_tokens]: the keys each row's query sees


class TorchKernels(TorchDecoderKernels):
    name = "torch"

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """k, v [T, kv_heads, head_dim] -> cache slots slot_mapping int64 [T] (block * tpb + offset)."""
        num_kv_heads, head_dim = k_cache.shape[2:]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))

    def copy_blocks(self, kv_pool: torch.Tensor, src_block_ids: torch.Tensor, dst_block_ids: torch.Tensor) -> None:
        """kv_pool [num_layers, 2, num_blocks, ...]: blocks src[i] -> dst[i] in every layer."""
        if src_block_ids.numel():
            kv_pool[:, :, dst_block_ids.long()] = kv_pool[:, :, src_block_ids.long()]

    def gather_kv(self, cache: torch.Tensor, block_tables: torch.Tensor, num_tokens: int,
                  workspace_slot: int | None = None) -> torch.Tensor:
        """[B, num_tokens, kv_heads, head_dim]: the first num_tokens cached tokens of each row.

        With `workspace_slot` the result lives in this thread's reusable buffer of that slot and
        is only valid until the next gather into the same slot."""
        return self._gather(cache, _block_ids(block_tables, num_tokens, cache.shape[1]), block_tables.shape[0],
                            num_tokens, workspace_slot)

    def _gather(self, cache: torch.Tensor, block_ids: torch.Tensor, num_rows: int, num_tokens: int,
                workspace_slot: int | None) -> torch.Tensor:
        # NOTE: index_select over flat block ids copies about twice as fast as advanced indexing.
        if workspace_slot is None:
            blocks = cache.index_select(0, block_ids)  # [B * nb, tpb, kvH, D]
        else:
            shape = (block_ids.numel(), *cache.shape[1:])
            out = self._workspace(workspace_slot, math.prod(shape), cache.dtype, cache.device).view(shape)
            blocks = torch.index_select(cache, 0, block_ids, out=out)
        return blocks.view(num_rows, -1, *cache.shape[2:])[:, :num_tokens]

    def _thread_state(self) -> dict:
        """State private to the calling thread: gather buffers and the last decode plan."""
        return self.__dict__.setdefault("_thread_states", threading.local()).__dict__

    def _workspace(self, slot: int, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat buffer of at least `numel` elements, owned by the calling thread, grown on demand.

        NOTE: the gathered keys and values of a decode step are several MB per layer; allocated
        afresh each layer they come from mmap under glibc's default malloc and page-fault on every
        write: a batch-34 step with 40-384 cached tokens took 135 ms against 54 ms with reuse."""
        buffers = self._thread_state()
        key = ("workspace", slot, dtype, device)
        buffer = buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = buffers[key] = torch.empty(max(numel, 2 * (0 if buffer is None else buffer.numel())),
                                                dtype=dtype, device=device)
        return buffer[:numel]

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                         window: int | None, sink: int = 0) -> torch.Tensor:
        """One query per sequence at position seq_lens - 1. q [B, H, D] -> [B, H, D].

        seq_lens int [B] counts the cached tokens including the query's own (already written).
        """
        plan = self._decode_plan(block_tables, seq_lens, k_cache.shape[1], window, sink, q.device)
        if len(plan) == 1:
            return self._decode_rows(q, k_cache, v_cache, plan[0], scale)
        out = torch.empty_like(q)
        for group in plan:
            out[group.rows] = self._decode_rows(q[group.rows], k_cache, v_cache, group, scale)
        return out

    def _decode_plan(self, block_tables: torch.Tensor, seq_lens: torch.Tensor, tokens_per_block: int,
                     window: int | None, sink: int, device: torch.device) -> list[_DecodeGroup]:
        """The row groups, block ids and masks of a decode call. Every layer of a step asks for the
        same plan, so the thread's last one is reused while its inputs are equal."""
        lens = seq_lens.tolist()
        key = (lens, tokens_per_block, window, sink, device)
        state = self._thread_state()
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
            query_pos = torch.tensor([lens[r] - 1 for r in rows], device=device)
            visible = _visible(query_pos, torch.arange(num_tokens, device=device), window, sink)  # [n, L]
            plan.append(_DecodeGroup(index, _block_ids(tables, num_tokens, tokens_per_block), len(rows),
                                     num_tokens, visible[:, None, None, :]))
        state["decode_plan"] = (key, block_tables.clone(), plan)
        return plan

    def _decode_rows(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: _DecodeGroup,
                     scale: float) -> torch.Tensor:
        """decode_attention over one group's rows, padded to their longest sequence."""
        dtype = _compute_dtype(q)
        # [n, kvH, L, D] views of the gathered keys and values (SDPA takes the strides as they are)
        k = self._gather(k_cache, group.block_ids, group.num_rows, group.num_tokens, 0).to(dtype).transpose(1, 2)
        v = self._gather(v_cache, group.block_ids, group.num_rows, group.num_tokens, 1).to(dtype).transpose(1, 2)
        out = F.scaled_dot_product_attention(q.to(dtype)[:, :, None, :], k, v, attn_mask=group.mask, scale=scale,
                                             enable_gqa=True)  # [n, H, 1, D]
        return out[:, :, 0].to(q.dtype)

    def context_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_table: torch.Tensor, past_len: int, scale: float,
                          window: int | None, sink: int = 0) -> torch.Tensor:
        """Queries at positions past_len .. past_len + n - 1 of one sequence whose keys
        (including the n new ones) are in the cache. q [n, H, D] -> [n, H, D]."""
        n = q.shape[0]
        total = past_len + n
        dtype = _compute_dtype(q)
        k = self.gather_kv(k_cache, block_table[None], total, workspace_slot=0)[0].to(dtype)  # [total, kvH, D]
        v = self.gather_kv(v_cache, block_table[None], total, workspace_slot=1)[0].to(dtype)
        return self.dense_attention(q.to(dtype), k, v, past_len, scale, window, sink).to(q.dtype)

    @staticmethod
    def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past_len: int, scale: float,
                        window: int | None, sink: int = 0) -> torch.Tensor:
        """q [n, H, D] at positions past_len.., k/v [past_len + n, kvH, D] -> [n, H, D]."""
        n, total = q.shape[0], k.shape[0]
        qt, kt, vt = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        if past_len == 0 and window is None:
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
        else:
            query_pos = torch.arange(past_len, total, device=q.device)
            key_pos = torch.arange(total, device=q.device)
            mask = _visible(query_pos, key_pos, window, sink)
            out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)
