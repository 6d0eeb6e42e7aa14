"""Torch reference of the KV-cache and attention operations: plain functions, each the definition
its CUDA kernel and the CPU fast paths (cpu_attention.py) are tested against. Layouts and
semantics: interface.py. Attention math runs in float32 on CPU (fp16/bf16 storage is upcast), in
the storage dtype on GPU. A quantized cache (int8 / fp8, kv_quant.py) comes with float32 scales
[num_blocks, tokens_per_block, kv_heads] per K and V; its keys and values are read as q * scale.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kv_quant import dequantize, quantize_rows


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float32 if t.device.type == "cpu" else t.dtype


def visible(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None, sink: int = 0) -> torch.Tensor:
    """bool mask [..., num_queries, num_keys]: causal, limited to the window (plus the sink
    tokens) when one is set."""
    mask = key_pos[..., None, :] <= query_pos[..., :, None]
    if window is not None:
        in_window = key_pos[..., None, :] > query_pos[..., :, None] - window
        mask &= in_window | (key_pos[..., None, :] < sink)
    return mask


def alibi_mask(mask: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor, alibi_slopes: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
    """An additive mask [..., H, num_queries, num_keys] in `dtype` from a visibility mask [...,
    num_queries, num_keys]: slope_h * (key_pos - query_pos) where visible, -inf elsewhere."""
    distance = (key_pos[..., None, :] - query_pos[..., :, None]).to(torch.float32)  # [..., nq, nk]
    bias = alibi_slopes.to(torch.float32)[:, None, None] * distance[..., None, :, :]  # [..., H, nq, nk]
    return bias.masked_fill(~mask[..., None, :, :], float("-inf")).to(dtype)


def block_ids(block_tables: torch.Tensor, num_tokens: int, tokens_per_block: int) -> torch.Tensor:
    """int64 [B * nb]: the blocks holding each row's first num_tokens tokens, row-major.
    Released blocks (negative ids) hold only invisible keys: block 0 is read in their place."""
    num_blocks = -(-num_tokens // tokens_per_block)
    return block_tables[:, :num_blocks].long().clamp(min=0).flatten()


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[B, num_tokens, kv_heads, head_dim]: the first num_tokens cached tokens of each row."""
    num_rows, tokens_per_block = block_tables.shape[0], cache.shape[1]
    # NOTE: index_select over flat block ids copies about twice as fast as advanced indexing.
    blocks = cache.index_select(0, block_ids(block_tables, num_tokens, tokens_per_block))  # [B * nb, tpb, kvH, D]
    return blocks.view(num_rows, -1, *cache.shape[2:])[:, :num_tokens]


def gather_dequantized(cache: torch.Tensor, scales: torch.Tensor | None, block_tables: torch.Tensor,
                       num_tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """gather_kv in `dtype`; a quantized cache's rows times their scales (float32 math)."""
    if scales is None:
        return gather_kv(cache, block_tables, num_tokens).to(dtype)
    return dequantize(gather_kv(cache, block_tables, num_tokens), gather_kv(scales, block_tables, num_tokens), dtype)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, k_scales: torch.Tensor | None = None,
             v_scales: torch.Tensor | None = None) -> None:
    num_kv_heads, head_dim = k_cache.shape[2:]
    for cache, x, scales in ((k_cache, k, k_scales), (v_cache, v, v_scales)):
        if scales is None:
            cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, x.to(cache.dtype))
            continue
        q, row_scales = quantize_rows(x, cache.dtype)   # [T, kvH, D], [T, kvH]
        # NOTE: float8 has no index_copy_ kernel on CPU; its bytes move as uint8.
        cache.view(torch.uint8).view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, q.view(torch.uint8))
        scales.view(-1, num_kv_heads).index_copy_(0, slot_mapping, row_scales)


def copy_blocks(kv_pool: torch.Tensor, src_block_ids: torch.Tensor, dst_block_ids: torch.Tensor) -> None:
    if src_block_ids.numel():
        pool = kv_pool.view(torch.uint8) if kv_pool.dtype == torch.float8_e4m3fn else kv_pool   # bytes move as is
        pool[:, :, dst_block_ids.long()] = pool[:, :, src_block_ids.long()]


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, window: int | None, sink: int = 0,
                     alibi_slopes: torch.Tensor | None = None, k_scales: torch.Tensor | None = None,
                     v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """One padded call: every row gathers as many keys as the longest row; the mask hides the
    padding, the keys outside the window and the future."""
    if q.shape[0] == 0:
        return torch.empty_like(q)
    dtype = compute_dtype(q) if k_scales is None else torch.float32   # quantized: fp32 accumulation
    num_tokens = int(seq_lens.max())
    k = gather_dequantized(k_cache, k_scales, block_tables, num_tokens, dtype).transpose(1, 2)  # [B, kvH, L, D]
    v = gather_dequantized(v_cache, v_scales, block_tables, num_tokens, dtype).transpose(1, 2)
    query_pos = (seq_lens.to(q.device) - 1)[:, None]  # [B, 1]
    key_pos = torch.arange(num_tokens, device=q.device)
    mask = visible(query_pos, key_pos, window, sink)  # [B, 1, L]
    mask = mask[:, None] if alibi_slopes is None else alibi_mask(mask, query_pos, key_pos, alibi_slopes, dtype)
    out = F.scaled_dot_product_attention(q.to(dtype)[:, :, None, :], k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=True)  # [B, H, 1, D]
    return out[:, :, 0].to(q.dtype)


def context_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                      past_len: int, scale: float, window: int | None, sink: int = 0,
                      alibi_slopes: torch.Tensor | None = None, k_scales: torch.Tensor | None = None,
                      v_scales: torch.Tensor | None = None) -> torch.Tensor:
    total = past_len + q.shape[0]
    dtype = compute_dtype(q) if k_scales is None else torch.float32
    k = gather_dequantized(k_cache, k_scales, block_table[None], total, dtype)[0]  # [total, kvH, D]
    v = gather_dequantized(v_cache, v_scales, block_table[None], total, dtype)[0]
    return dense_attention(q.to(dtype), k, v, past_len, scale, window, sink, alibi_slopes).to(q.dtype)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past_len: int, scale: float,
                    window: int | None, sink: int = 0, alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    total = k.shape[0]
    qt, kt, vt = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, H, n | total, D]
    if past_len == 0 and window is None and alibi_slopes is None:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
    else:
        query_pos, key_pos = torch.arange(past_len, total, device=q.device), torch.arange(total, device=q.device)
        mask = visible(query_pos, key_pos, window, sink)  # [n, total]
        if alibi_slopes is not None:
            mask = alibi_mask(mask, query_pos, key_pos, alibi_slopes, q.dtype)  # [H, n, total]
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)
