"""The float32 per-op entry points of the native CPU layer (library.py): few-row linear, RMSNorm,
the gated MLP's silu(gate) * up, paged decode attention in float32 (and over an int8 cache), a
context step's causal attention, the token bitmask and the shared-memory all-reduce. Callers, all in
the torch backend: linear.py (rows up to linear.NATIVE_MAX_ROWS), torch_backend.py (RMSNorm, silu *
up, the token bitmask) and cpu_attention.py (decode and context attention); each keeps its torch
path for every other case, and tests hold these kernels to it.

`native_ops()` is None where the kernels cannot run (no x86-64 AVX2/FMA, no compiler, or
BATCH_MANAGER_CPU_NATIVE=0); callers then stay on torch. `load_ops` gives the other binding
modules (cpu_native_bf16, cpu_weight_only, act_quant) the same rule over the same library.
"""
from __future__ import annotations

import ctypes
import functools
import os

import torch

from . import library
from ...errors import ConfigError
from ...quantization import lookup_dtype
from ...quantization.native_codes import WEIGHT_FORMATS, weight_code

ENV_VAR = "BATCH_MANAGER_CPU_NATIVE"  # "0" turns the native kernels off (A/B runs, debugging)
# The quantized rows of the native format table (formats.h's kWeightInt8, kWeightInt4)
INT8_CODE, INT4_CODE = weight_code("int8"), weight_code("int4")


def quantized_code(weight: torch.Tensor) -> int:
    """The native format code of a quantized weight, its format found by W's stored dtype (the
    registry's kernels' key); ConfigError naming the format when the native table has no kernel for it."""
    weight_format = lookup_dtype(weight.dtype)
    code = None if weight_format is None else weight_format.native_code
    if code not in (INT8_CODE, INT4_CODE):
        name = weight.dtype if weight_format is None else repr(weight_format.name)
        raise ConfigError(f"weight_only: weight format {name} has no native CPU kernel (the native format table "
                          f"runs {', '.join(WEIGHT_FORMATS)}); add its row and kernels, or run it off the CPU")
    return code


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


# The wrappers' shared bodies: the float32 kernels below and the bf16 ones (cpu_native_bf16.py)
# differ only in the element type and the entry point.

def call_rms_norm(fn, x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """x [rows, h] (rows contiguous), weight [h], both `dtype` -> x * rsqrt(mean(x^2) + eps) * weight."""
    assert x.dtype == weight.dtype == dtype and x.dim() == 2 and x.stride(1) == 1
    out = torch.empty(x.shape, dtype=dtype)
    fn(x.data_ptr(), x.shape[0], x.stride(0), x.shape[1], weight.contiguous().data_ptr(), eps, out.data_ptr(),
       out.stride(0), torch.get_num_threads())
    return out


def call_silu_mul(fn, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x `dtype` [rows, 2n] (gate | up, rows contiguous) -> silu(gate) * up [rows, n]."""
    assert x.dtype == dtype and x.dim() == 2 and x.stride(1) == 1 and x.shape[1] % 2 == 0
    rows, n = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, n, dtype=dtype)
    fn(x.data_ptr(), rows, x.stride(0), n, out.data_ptr(), torch.get_num_threads())
    return out


def decode_arguments(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, tuple]:
    """(q contiguous, tables int32, lens int64, out like q, (batch, heads, kv heads, head_dim,
    tokens_per_block)) of a decode-attention call over caches [blocks, tpb, kvH, D] read in place."""
    q = q.contiguous()
    batch, num_heads, head_dim = q.shape
    _, tokens_per_block, num_kv_heads, _ = k_cache.shape
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int64).contiguous()
    return q, tables, lens, torch.empty_like(q), (batch, num_heads, num_kv_heads, head_dim, tokens_per_block)


def call_decode_attention(fn, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, window: int | None,
                          sink: int, dtype: torch.dtype) -> torch.Tensor:
    """interface.KernelBackend.decode_attention for `dtype` q and caches, reading the blocks in place."""
    assert q.dtype == k_cache.dtype == v_cache.dtype == dtype
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    q, tables, lens, out, (batch, num_heads, num_kv_heads, head_dim, tpb) = decode_arguments(
        q, k_cache, block_tables, seq_lens)
    fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.shape[1], lens.data_ptr(),
       batch, num_heads, num_kv_heads, head_dim, tpb, scale, -1 if window is None else window, sink,
       out.data_ptr(), torch.get_num_threads())
    return out


class NativeCpuOps:
    """The loaded library; every method takes float32 CPU tensors and checks the layout it needs."""

    def __init__(self, lib: ctypes.CDLL):
        self._lib = lib

    def shm_all_reduce(self, data: torch.Tensor, region: torch.Tensor, capacity: int, rank: int, size: int,
                       seq: int, timeout_s: float, gathered: torch.Tensor | None = None) -> int:
        """data float32 contiguous, numel n <= capacity: summed over the ranks in place through
        `region` (uint8, shared by the ranks; see bm_shm_all_reduce); with `gathered` (float32
        [size, >= n] view, rows contiguous) each rank's data lands in its row instead. -> 0, 1
        (timed out), 2 (a peer's process is gone)."""
        assert data.dtype == torch.float32 and data.is_contiguous() and data.numel() <= capacity
        if gathered is not None:
            assert gathered.dtype == torch.float32 and gathered.shape[0] == size and gathered.stride(1) == 1
        return self._lib.bm_shm_all_reduce(data.data_ptr(), data.numel(), region.data_ptr(), capacity, rank, size, seq,
                                           int(timeout_s * 1e9), _ptr(gathered),
                                           0 if gathered is None else gathered.stride(0))

    def apply_token_bitmask(self, logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
        """interface.KernelBackend.apply_token_bitmask for float32 logits with contiguous columns."""
        assert logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.stride(1) == 1
        rows = rows.to("cpu", torch.int64).contiguous()
        bitmask = bitmask.to("cpu", torch.int32).contiguous()
        n, vocab = rows.shape[0], logits.shape[1]
        assert bitmask.shape[0] == n and bitmask.shape[1] * 32 >= vocab
        if n and vocab:
            self._lib.bm_token_bitmask(logits.data_ptr(), rows.data_ptr(), bitmask.data_ptr(), n, bitmask.shape[1],
                                       vocab, logits.stride(0), torch.get_num_threads())

    def greedy(self, logits: torch.Tensor, no_token: int) -> tuple[torch.Tensor, torch.Tensor]:
        """interface.KernelBackend.greedy (its NO_TOKEN passed as `no_token`) for float32 logits
        [rows, vocab] with contiguous columns:
        one native pass for the maximum, one for the sum (torch: argmax, logsumexp, gather and the
        empty-row check, ~0.45 ms for one row of 49152)."""
        assert logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.dim() == 2
        assert logits.stride(1) == 1
        rows, vocab = logits.shape
        tokens = torch.empty(rows, dtype=torch.int64)
        log_probs = torch.empty(rows, dtype=torch.float32)
        if rows and vocab:
            self._lib.bm_greedy(logits.data_ptr(), rows, vocab, logits.stride(0), no_token, tokens.data_ptr(),
                                log_probs.data_ptr(), torch.get_num_threads())
        elif rows:
            tokens.fill_(no_token), log_probs.fill_(float("-inf"))
        return tokens, log_probs

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, in] (rows contiguous), weight [out, in] contiguous, bias [out] or None ->
        [rows, out]. With `out` (float32 [rows, out], rows contiguous) the product is ADDED into it."""
        assert x.dtype == weight.dtype == torch.float32 and x.stride(1) == 1 and weight.is_contiguous()
        rows, (n, k) = x.shape[0], weight.shape
        accumulate = out is not None
        if out is None:
            out = torch.empty(rows, n, dtype=torch.float32)
        assert out.shape == (rows, n) and out.stride(1) == 1 and x.shape[1] == k
        self._lib.bm_linear(x.data_ptr(), rows, x.stride(0), weight.data_ptr(), n, k, _ptr(bias), out.data_ptr(),
                            out.stride(0), int(accumulate), torch.get_num_threads())
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [rows, h] (rows contiguous), weight [h] -> x * rsqrt(mean(x^2) + eps) * weight."""
        return call_rms_norm(self._lib.bm_rms_norm, x, weight, eps, torch.float32)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, 2n] (gate | up, rows contiguous) -> silu(gate) * up [rows, n]: the gated MLP's hidden."""
        return call_silu_mul(self._lib.bm_silu_mul, x, torch.float32)

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                         window: int | None, sink: int = 0) -> torch.Tensor:
        """interface.KernelBackend.decode_attention for float32 caches, reading the blocks in place."""
        return call_decode_attention(self._lib.bm_decode_attention, q, k_cache, v_cache, block_tables, seq_lens, scale,
                                     window, sink, torch.float32)

    def decode_attention_int8(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              k_scales: torch.Tensor, v_scales: torch.Tensor, block_tables: torch.Tensor,
                              seq_lens: torch.Tensor, scale: float, window: int | None, sink: int = 0) -> torch.Tensor:
        """interface.KernelBackend.decode_attention for int8 caches with their float32 scales
        [num_blocks, tpb, kvH] and float32 queries, reading the blocks in place."""
        assert q.dtype == torch.float32 and k_cache.dtype == v_cache.dtype == torch.int8
        assert k_scales.dtype == v_scales.dtype == torch.float32 and k_scales.shape == k_cache.shape[:-1]
        assert k_cache.is_contiguous() and v_cache.is_contiguous()
        assert k_scales.is_contiguous() and v_scales.is_contiguous() and v_scales.shape == k_scales.shape
        q, tables, lens, out, (batch, num_heads, num_kv_heads, head_dim, tokens_per_block) = decode_arguments(
            q, k_cache, block_tables, seq_lens)
        self._lib.bm_decode_attention_int8(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_scales.data_ptr(),
                                           v_scales.data_ptr(), tables.data_ptr(), tables.shape[1], lens.data_ptr(),
                                           batch, num_heads, num_kv_heads, head_dim, tokens_per_block, scale,
                                           -1 if window is None else window, sink, out.data_ptr(),
                                           torch.get_num_threads())
        return out


    def dense_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Causal attention of a context step: q float32 [n, H, D], k and v [total, kvH, D] (head rows
        contiguous, token rows at any stride), query i at position total - n + i, D % 16 == 0 ->
        [n, H, D] (torch_attention.dense_attention without window or ALiBi)."""
        assert q.dtype == k.dtype == v.dtype == torch.float32 and q.dim() == k.dim() == v.dim() == 3
        (n, num_heads, head_dim), (total, num_kv_heads, _) = q.shape, k.shape
        assert v.shape == k.shape and k.shape[2] == head_dim and head_dim % 16 == 0 and total >= n
        assert num_heads % num_kv_heads == 0
        assert all(t.stride(2) == 1 and t.stride(1) == head_dim for t in (q, k, v))
        out = torch.empty(n, num_heads, head_dim, dtype=torch.float32)
        if n:
            self._lib.bm_dense_attention(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(),
                                         v.stride(0), out.data_ptr(), out.stride(0), n, total, num_heads,
                                         num_kv_heads, head_dim, scale, torch.get_num_threads())
        return out

def native_ops() -> NativeCpuOps | None:
    """The kernels (built and loaded once per process); None where they cannot run here or while
    BATCH_MANAGER_CPU_NATIVE=0. Callers capture the answer when they are built."""
    return load_ops(NativeCpuOps)


def load_ops(ops_class):
    """`ops_class(lib)` over the native library, made once per process; None where the kernels cannot
    run here (library.load() is None) or while BATCH_MANAGER_CPU_NATIVE=0 (callers stay on torch)."""
    if os.environ.get(ENV_VAR, "").strip() == "0":
        return None
    lib = library.load()
    return None if lib is None else _bound(ops_class, lib)


@functools.lru_cache(maxsize=None)
def _bound(ops_class, lib: ctypes.CDLL):
    return ops_class(lib)
