"""Typed launchers of the KV-cache and decode-attention kernels (the decoding kernels' are in
decoding_launchers.py), shared by the cuda and emu backends.

Each launcher asserts the kernel's launch contract (device, dtype, contiguity, shapes; see the
header of each cuda_src/*.cu), converts every argument to its exact C type (pointers ->
numpy.uint64, `int` -> numpy.int32, `long long` -> numpy.int64, `float` -> numpy.float32: CuPy
sends a Python int as 8 bytes and a Python float as a double), guards empty work (CuPy clamps an
empty grid to one block) and launches on the stream its backend hands out at each launch.

A backend provides `function(dtype, name)`: a callable with CuPy's RawKernel call signature
`(grid, block, args, shared_mem=0, stream=None)`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
MAX_SHARED_BYTES = 48 * 1024     # static limit without opting in to more dynamic shared memory
_INT32_MAX = 2 ** 31 - 1


@dataclass(frozen=True)
class LaunchConfig:
    attention_threads: int = 128     # NUM_THREADS of decode_attention_partition (multiple of 32)
    threads_per_key: int = 8         # THREADS_PER_KEY: lanes sharing one key's dot products
    partition_size: int = 512        # visible keys per CTA (flash-decoding split), at least
    max_partitions: int = 64         # ... so long tables use at most this many CTAs per KV head
    tile_size: int = 512             # keys per shared-memory tile inside a CTA (shrunk to fit)
    copy_threads: int = 256          # block size of the copy kernels and the merge
    decoding_threads: int = 1024     # largest block of the per-row decoding kernels (see decoding_block)

    def __post_init__(self):
        for name in ("attention_threads", "copy_threads", "decoding_threads"):
            if getattr(self, name) % 32 or not 32 <= getattr(self, name) <= 1024:
                raise ValueError(f"{name}: must be a multiple of 32 in [32, 1024], got {getattr(self, name)}")
        if self.threads_per_key not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"threads_per_key: must be a power of two <= 32, got {self.threads_per_key}")
        for name in ("partition_size", "max_partitions", "tile_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")

    def defines(self, dtype: torch.dtype) -> dict[str, int]:
        """The `#define`s that specialise every module for `dtype`."""
        return {"DTYPE": DTYPE_CODES[dtype], "NUM_THREADS": self.attention_threads,
                "THREADS_PER_KEY": self.threads_per_key}


def c_ptr(t: torch.Tensor | None) -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


def c_int(value: int) -> np.int32:
    value = int(value)
    assert -_INT32_MAX - 1 <= value <= _INT32_MAX, f"{value} does not fit a C int"
    return np.int32(value)


def c_long_long(value: int) -> np.int64:
    return np.int64(int(value))


def c_float(value: float) -> np.float32:
    return np.float32(float(value))


def decode_smem_bytes(group: int, head_dim: int, tile_size: int, quantized: bool = False) -> int:
    """Dynamic shared memory of decode_attention_partition (mirrors its carving); quantized: of
    decode_attention_partition_int8 (two scales per tile key more)."""
    floats = 2 * group * head_dim + group * tile_size + 3 * group
    floats += floats & 1
    return floats * 4 + tile_size * (16 if quantized else 8)


def fit_tile_size(group: int, head_dim: int, wanted: int, quantized: bool = False) -> int:
    """The largest tile <= wanted whose shared memory fits MAX_SHARED_BYTES."""
    per_key = 4 * group + (16 if quantized else 8)
    largest = (MAX_SHARED_BYTES - decode_smem_bytes(group, head_dim, 0) - 4) // per_key
    if largest < 1:
        raise ValueError(f"decode attention: {group} query heads per KV head x head_dim {head_dim} do not fit "
                         f"{MAX_SHARED_BYTES} bytes of shared memory")
    return min(wanted, largest)


def plan_partitions(max_visible: int, config: LaunchConfig) -> tuple[int, int]:
    """(partition_size, num_partitions) for up to max_visible keys per sequence.

    NOTE: sized from the block-table width (a host shape), not from the sequence lengths (device
    data): no sync per step; CTAs past a sequence's visible keys exit at once. The partial-result
    buffer is batch x heads x num_partitions x head_dim floats, hence max_partitions.
    """
    partition_size = max(config.partition_size, -(-max_visible // config.max_partitions))
    return partition_size, max(1, -(-max_visible // partition_size))


class KvLaunchers:
    """The launchers of cuda_src/kv_cache.cu and cuda_src/paged_attention.cu."""

    def __init__(self, function: Callable, device_type: str, stream: Callable, config: LaunchConfig):
        self._function = function          # (dtype, kernel name) -> launchable kernel
        self._device_type = device_type    # "cuda" or "cpu" (emu)
        self._stream = stream              # device -> stream object for this launch (fetched every time)
        self.config = config

    def _check(self, name: str, t: torch.Tensor, dtype: torch.dtype | tuple, dim: int | None = None) -> None:
        assert t.device.type == self._device_type, f"{name}: on {t.device}, expected {self._device_type}"
        dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
        assert t.dtype in dtypes, f"{name}: dtype {t.dtype}, expected {dtypes}"
        assert dim is None or t.dim() == dim, f"{name}: shape {list(t.shape)}, expected {dim} dims"

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scales: torch.Tensor | None = None,
                 v_scales: torch.Tensor | None = None) -> None:
        """k, v [T, kvH, D] (rows contiguous, any token stride) -> slots int64 [T] of k_cache, v_cache
        [num_blocks, tpb, kvH, D] (contiguous); with k_scales, v_scales (float32 [num_blocks, tpb,
        kvH], contiguous) the caches are int8 and k, v any compiled storage dtype (write_kv_quant)."""
        quantized = k_scales is not None
        dtype = k.dtype if quantized else k_cache.dtype
        for name, t, rank in (("k_cache", k_cache, 4), ("v_cache", v_cache, 4)):
            self._check(name, t, torch.int8 if quantized else dtype, rank)
        for name, t, rank in (("k", k, 3), ("v", v, 3)):
            self._check(name, t, dtype, rank)
        if quantized:
            for name, t in (("k_scales", k_scales), ("v_scales", v_scales)):
                self._check(name, t, torch.float32, 3)
                assert t.is_contiguous() and t.shape == k_cache.shape[:3], (name, t.shape, k_cache.shape)
        self._check("slot_mapping", slot_mapping, torch.int64, 1)
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
        num_tokens, num_kv_heads, head_dim = k.shape
        assert v.shape == k.shape and k_cache.shape[2:] == (num_kv_heads, head_dim), (k.shape, k_cache.shape)
        assert slot_mapping.shape == (num_tokens,) and slot_mapping.is_contiguous()
        for t in (k, v):
            assert t.stride(2) == 1 and (num_kv_heads == 1 or t.stride(1) == head_dim), \
                f"K/V rows must be contiguous, strides {t.stride()}"
        if num_tokens == 0:
            return
        if quantized:
            kernel = self._function(dtype, "write_kv_quant")
            kernel((num_tokens,), (self.config.copy_threads,),
                   (c_ptr(k_cache), c_ptr(v_cache), c_ptr(k_scales), c_ptr(v_scales), c_ptr(k), c_ptr(v),
                    c_ptr(slot_mapping), c_int(num_kv_heads), c_int(head_dim), c_long_long(k.stride(0)),
                    c_long_long(v.stride(0))),
                   shared_mem=0, stream=self._stream(k_cache.device))
            return
        kernel = self._function(dtype, "write_kv")
        kernel((num_tokens,), (self.config.copy_threads,),
               (c_ptr(k_cache), c_ptr(v_cache), c_ptr(k), c_ptr(v), c_ptr(slot_mapping),
                c_int(num_kv_heads * head_dim), c_long_long(k.stride(0)), c_long_long(v.stride(0))),
               shared_mem=0, stream=self._stream(k_cache.device))

    def copy_blocks(self, kv_pool: torch.Tensor, src_block_ids: torch.Tensor, dst_block_ids: torch.Tensor) -> None:
        """kv_pool [num_layers, 2, num_blocks, ...] (contiguous); int64 [P] src -> dst in every layer.

        NOTE: the pairs are copied concurrently, so destinations must be distinct and no destination
        may also be a source (copy-on-write into fresh blocks); checking that here would cost a
        device-to-host sync per call.
        """
        self._check("kv_pool", kv_pool, tuple(DTYPE_CODES))
        self._check("src_block_ids", src_block_ids, torch.int64, 1)
        self._check("dst_block_ids", dst_block_ids, torch.int64, 1)
        assert kv_pool.dim() >= 3 and kv_pool.is_contiguous()
        assert src_block_ids.is_contiguous() and dst_block_ids.shape == src_block_ids.shape \
            and dst_block_ids.is_contiguous()
        num_pairs = src_block_ids.numel()
        num_planes = kv_pool.shape[0] * kv_pool.shape[1]
        num_blocks = kv_pool.shape[2]
        if num_pairs == 0 or kv_pool.numel() == 0:
            return
        assert num_planes <= 65535, f"grid.y {num_planes} exceeds 65535"
        kernel = self._function(kv_pool.dtype, "copy_blocks")
        kernel((num_pairs, num_planes), (self.config.copy_threads,),
               (c_ptr(kv_pool), c_ptr(src_block_ids), c_ptr(dst_block_ids), c_long_long(num_blocks),
                c_long_long(kv_pool[0, 0, 0].numel())),
               shared_mem=0, stream=self._stream(kv_pool.device))

    def decode_attention(self, out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, window: int,
                         sink: int, alibi_slopes: torch.Tensor | None = None, k_scales: torch.Tensor | None = None,
                         v_scales: torch.Tensor | None = None) -> None:
        """out, q [B, H, D]; caches [num_blocks, tpb, kvH, D]; block_tables int32 [B, W]; seq_lens
        int32 [B] (>= 1); window 0 = none; alibi_slopes float32 [H] or None; with k_scales, v_scales
        (float32 [num_blocks, tpb, kvH]) int8 caches. All contiguous."""
        quantized = k_scales is not None
        dtype = q.dtype
        for name, t, rank in (("out", out, 3), ("q", q, 3), ("k_cache", k_cache, 4), ("v_cache", v_cache, 4)):
            self._check(name, t, torch.int8 if quantized and name.endswith("cache") else dtype, rank)
            assert t.is_contiguous(), f"{name}: must be contiguous"
        if quantized:
            for name, t in (("k_scales", k_scales), ("v_scales", v_scales)):
                self._check(name, t, torch.float32, 3)
                assert t.is_contiguous() and t.shape == k_cache.shape[:3], (name, t.shape, k_cache.shape)
        self._check("block_tables", block_tables, torch.int32, 2)
        self._check("seq_lens", seq_lens, torch.int32, 1)
        batch, num_heads, head_dim = q.shape
        _, tokens_per_block, num_kv_heads, _ = k_cache.shape
        assert out.shape == q.shape and v_cache.shape == k_cache.shape and k_cache.shape[3] == head_dim
        assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
        assert block_tables.shape[0] == batch and seq_lens.shape == (batch,)
        assert block_tables.is_contiguous() and seq_lens.is_contiguous()
        assert window >= 0 and sink >= 0
        if alibi_slopes is not None:
            self._check("alibi_slopes", alibi_slopes, torch.float32, 1)
            assert alibi_slopes.shape == (num_heads,) and alibi_slopes.is_contiguous(), alibi_slopes.shape
        if batch == 0:
            return
        group = num_heads // num_kv_heads
        max_visible = block_tables.shape[1] * tokens_per_block
        if window:
            max_visible = min(max_visible, window + sink)
        partition_size, num_partitions = plan_partitions(max_visible, self.config)
        tile_size = fit_tile_size(group, head_dim, min(self.config.tile_size, partition_size), quantized)
        assert num_kv_heads <= 65535 and batch <= 65535, (num_kv_heads, batch)
        part_acc = part_max = part_sum = None
        if num_partitions > 1:  # NOTE: freed on return; safe, torch's allocator is ordered on this stream
            part_acc = torch.empty(batch, num_heads, num_partitions, head_dim, dtype=torch.float32, device=q.device)
            part_max = torch.empty(batch, num_heads, num_partitions, dtype=torch.float32, device=q.device)
            part_sum = torch.empty_like(part_max)
        stream = self._stream(q.device)
        kernel = self._function(dtype, "decode_attention_partition_int8" if quantized else "decode_attention_partition")
        caches = (c_ptr(k_cache), c_ptr(v_cache)) + ((c_ptr(k_scales), c_ptr(v_scales)) if quantized else ())
        kernel((num_partitions, num_kv_heads, batch), (self.config.attention_threads,),
               (c_ptr(out), c_ptr(part_acc), c_ptr(part_max), c_ptr(part_sum), c_ptr(q), *caches,
                c_ptr(block_tables), c_ptr(seq_lens), c_ptr(alibi_slopes), c_int(num_heads),
                c_int(num_kv_heads),
                c_int(head_dim), c_int(tokens_per_block), c_int(block_tables.shape[1]), c_int(partition_size),
                c_int(tile_size), c_float(scale), c_int(window), c_int(sink)),
               shared_mem=decode_smem_bytes(group, head_dim, tile_size, quantized), stream=stream)
        if num_partitions > 1:
            merge = self._function(dtype, "decode_attention_merge")
            merge((num_heads, batch), (min(self.config.copy_threads, 32 * -(-head_dim // 32)),),
                  (c_ptr(out), c_ptr(part_acc), c_ptr(part_max), c_ptr(part_sum), c_int(num_heads),
                   c_int(head_dim), c_int(num_partitions)),
                  shared_mem=0, stream=stream)
