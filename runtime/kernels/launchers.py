"""Typed launchers of the KV-cache, decode-attention and decoding kernels, shared by the cuda and emu
backends.

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
        if self.attention_threads % 32 or not 32 <= self.attention_threads <= 1024:
            raise ValueError(f"attention_threads: must be a multiple of 32 in [32, 1024], got {self.attention_threads}")
        if self.threads_per_key not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"threads_per_key: must be a power of two <= 32, got {self.threads_per_key}")
        for name in ("partition_size", "max_partitions", "tile_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")
        if self.copy_threads % 32 or not 32 <= self.copy_threads <= 1024:
            raise ValueError(f"copy_threads: must be a multiple of 32 in [32, 1024], got {self.copy_threads}")
        if self.decoding_threads % 32 or not 32 <= self.decoding_threads <= 1024:
            raise ValueError(f"decoding_threads: must be a multiple of 32 in [32, 1024], got {self.decoding_threads}")

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


def decode_smem_bytes(group: int, head_dim: int, tile_size: int) -> int:
    """Dynamic shared memory of decode_attention_partition (mirrors its carving)."""
    floats = 2 * group * head_dim + group * tile_size + 3 * group
    floats += floats & 1
    return floats * 4 + tile_size * 8


def fit_tile_size(group: int, head_dim: int, wanted: int) -> int:
    """The largest tile <= wanted whose shared memory fits MAX_SHARED_BYTES."""
    largest = (MAX_SHARED_BYTES - decode_smem_bytes(group, head_dim, 0) - 4) // (4 * group + 8)
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
                 slot_mapping: torch.Tensor) -> None:
        """k, v [T, kvH, D] (rows contiguous, any token stride) -> slots int64 [T] of k_cache, v_cache
        [num_blocks, tpb, kvH, D] (contiguous)."""
        dtype = k_cache.dtype
        for name, t, rank in (("k_cache", k_cache, 4), ("v_cache", v_cache, 4), ("k", k, 3), ("v", v, 3)):
            self._check(name, t, dtype, rank)
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
                         sink: int, alibi_slopes: torch.Tensor | None = None) -> None:
        """out, q [B, H, D]; caches [num_blocks, tpb, kvH, D]; block_tables int32 [B, W]; seq_lens
        int32 [B] (>= 1); window 0 = none; alibi_slopes float32 [H] or None. All contiguous."""
        dtype = k_cache.dtype
        for name, t, rank in (("out", out, 3), ("q", q, 3), ("k_cache", k_cache, 4), ("v_cache", v_cache, 4)):
            self._check(name, t, dtype, rank)
            assert t.is_contiguous(), f"{name}: must be contiguous"
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
        tile_size = fit_tile_size(group, head_dim, min(self.config.tile_size, partition_size))
        assert num_kv_heads <= 65535 and batch <= 65535, (num_kv_heads, batch)
        part_acc = part_max = part_sum = None
        if num_partitions > 1:  # NOTE: freed on return; safe, torch's allocator is ordered on this stream
            part_acc = torch.empty(batch, num_heads, num_partitions, head_dim, dtype=torch.float32, device=q.device)
            part_max = torch.empty(batch, num_heads, num_partitions, dtype=torch.float32, device=q.device)
            part_sum = torch.empty_like(part_max)
        stream = self._stream(q.device)
        kernel = self._function(dtype, "decode_attention_partition")
        kernel((num_partitions, num_kv_heads, batch), (self.config.attention_threads,),
               (c_ptr(out), c_ptr(part_acc), c_ptr(part_max), c_ptr(part_sum), c_ptr(q), c_ptr(k_cache),
                c_ptr(v_cache), c_ptr(block_tables), c_ptr(seq_lens), c_ptr(alibi_slopes), c_int(num_heads),
                c_int(num_kv_heads),
                c_int(head_dim), c_int(tokens_per_block), c_int(block_tables.shape[1]), c_int(partition_size),
                c_int(tile_size), c_float(scale), c_int(window), c_int(sink)),
               shared_mem=decode_smem_bytes(group, head_dim, tile_size), stream=stream)
        if num_partitions > 1:
            merge = self._function(dtype, "decode_attention_merge")
            merge((num_heads, batch), (min(self.config.copy_threads, 32 * -(-head_dim // 32)),),
                  (c_ptr(out), c_ptr(part_acc), c_ptr(part_max), c_ptr(part_sum), c_int(num_heads),
                   c_int(head_dim), c_int(num_partitions)),
                  shared_mem=0, stream=stream)


# ---- decoding kernels (cuda_src/philox.cu, logits_processing.cu, sampling.cu, beam_search.cu) ----
MIN_COLUMNS_PER_THREAD = 16


def decoding_block(vocab: int, config: LaunchConfig) -> int:
    """Threads of a per-row decoding CTA: a multiple of 32 giving each thread at least
    MIN_COLUMNS_PER_THREAD columns, at most config.decoding_threads.

    NOTE: a small vocabulary gets a small block (a 128-column row needs one warp): more rows fit
    an SM at once, and the emu backend's barriers stay cheap.
    """
    wanted = 32 * -(-vocab // (32 * MIN_COLUMNS_PER_THREAD))
    return max(32, min(config.decoding_threads, wanted))


class DecodingLaunchers:
    """The launchers of the decoding kernels. Logits are float32 whatever the storage dtype; these
    modules do not depend on it, so the backend hands any compiled dtype's module (`dtype`)."""

    _check = KvLaunchers._check

    def __init__(self, function: Callable, device_type: str, stream: Callable, config: LaunchConfig,
                 dtype: torch.dtype):
        self._kernel = lambda name: function(dtype, name)   # kernel name -> launchable kernel
        self._device_type = device_type
        self._stream = stream
        self.config = config

    def _vectors(self, n: int, dtype: torch.dtype, **tensors: torch.Tensor) -> None:
        for name, t in tensors.items():
            self._check(name, t, dtype, 1)
            assert t.shape == (n,) and t.is_contiguous(), f"{name}: shape {list(t.shape)}, expected [{n}] contiguous"

    def _logits(self, name: str, logits: torch.Tensor) -> None:
        self._check(name, logits, torch.float32, 2)
        assert logits.stride(1) == 1 or logits.shape[1] <= 1, f"{name}: columns must be contiguous"

    def _elementwise(self, name: str, n: int, args: tuple, device: torch.device) -> None:
        threads = self.config.copy_threads
        self._kernel(name)((-(-n // threads),), (threads,), args, shared_mem=0, stream=self._stream(device))

    def uniforms(self, out: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, beams: torch.Tensor,
                 lane: int = 0) -> None:
        """out float32 [n] <- Philox(seed, step, beam, lane); seeds (uint64 bit patterns), steps, beams int64 [n]."""
        n = out.shape[0]
        self._vectors(n, torch.float32, out=out)
        self._vectors(n, torch.int64, seeds=seeds, steps=steps, beams=beams)
        if n:
            self._elementwise("philox_uniforms", n, (c_ptr(out), c_ptr(seeds), c_ptr(steps), c_ptr(beams), c_int(n),
                                                     c_int(lane)), out.device)

    def philox_raw(self, out: torch.Tensor, counters: torch.Tensor, keys: torch.Tensor) -> None:
        """The raw block function: counters int32 [n, 4], keys int32 [n, 2] (uint32 bit patterns) -> out [n, 4]."""
        for name, t, width in (("out", out, 4), ("counters", counters, 4), ("keys", keys, 2)):
            self._check(name, t, torch.int32, 2)
            assert t.shape == (out.shape[0], width) and t.is_contiguous(), f"{name}: shape {list(t.shape)}"
        if out.shape[0]:
            self._elementwise("philox4x32_raw", out.shape[0], (c_ptr(out), c_ptr(counters), c_ptr(keys),
                                                               c_int(out.shape[0])), out.device)

    def apply_penalties(self, logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor,
                        token_lengths: torch.Tensor, embedding_bias: torch.Tensor | None, temperature: torch.Tensor,
                        repetition: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor,
                        min_lengths: torch.Tensor, num_generated: torch.Tensor, end_ids: torch.Tensor) -> None:
        """In place on logits float32 [R, V] rows `rows` int64 [n] (distinct); token_ids int64 [n, L];
        embedding_bias float32 [n, V] or None; per-row float32 / int64 [n] settings. All contiguous."""
        self._logits("logits", logits)
        n, vocab = rows.shape[0], logits.shape[1]
        self._vectors(n, torch.int64, rows=rows, token_lengths=token_lengths, min_lengths=min_lengths,
                      num_generated=num_generated, end_ids=end_ids)
        self._vectors(n, torch.float32, temperature=temperature, repetition=repetition, presence=presence,
                      frequency=frequency)
        self._check("token_ids", token_ids, torch.int64, 2)
        assert token_ids.shape[0] == n and token_ids.is_contiguous(), f"token_ids: shape {list(token_ids.shape)}"
        if embedding_bias is not None:
            self._check("embedding_bias", embedding_bias, torch.float32, 2)
            assert embedding_bias.shape == (n, vocab) and embedding_bias.is_contiguous()
        if n == 0 or vocab == 0:
            return
        # NOTE: n x vocab int32 of histogram workspace, freed on return (torch's allocator is stream-ordered)
        counts = torch.empty(n, vocab, dtype=torch.int32, device=logits.device)
        kernel = self._kernel("apply_penalties")
        kernel((n,), (decoding_block(vocab, self.config),),
               (c_ptr(logits), c_ptr(counts), c_ptr(rows), c_ptr(token_ids), c_ptr(token_lengths),
                c_ptr(embedding_bias), c_ptr(temperature), c_ptr(repetition), c_ptr(presence), c_ptr(frequency),
                c_ptr(min_lengths), c_ptr(num_generated), c_ptr(end_ids), c_int(vocab),
                c_long_long(logits.stride(0)), c_int(token_ids.shape[1])),
               shared_mem=0, stream=self._stream(logits.device))

    def ban_tokens(self, logits: torch.Tensor, row_ids: torch.Tensor, token_ids: torch.Tensor) -> None:
        """logits float32 [R, V][row_ids[i], token_ids[i]] = -inf; int64 [m] each (out-of-range pairs skipped)."""
        self._logits("logits", logits)
        m = row_ids.shape[0]
        self._vectors(m, torch.int64, row_ids=row_ids, token_ids=token_ids)
        if m == 0 or logits.numel() == 0:
            return
        self._elementwise("ban_tokens", m, (c_ptr(logits), c_ptr(row_ids), c_ptr(token_ids), c_int(m),
                                            c_long_long(logits.shape[0]), c_int(logits.shape[1]),
                                            c_long_long(logits.stride(0))), logits.device)

    def _per_row(self, name: str, logits: torch.Tensor, outputs: tuple, inputs: tuple = ()) -> None:
        num_rows, vocab = logits.shape
        if num_rows == 0:
            return
        assert vocab > 0, "an empty vocabulary has no token to pick"
        self._kernel(name)((num_rows,), (decoding_block(vocab, self.config),),
                           (*(c_ptr(t) for t in outputs), c_ptr(logits), *(c_ptr(t) for t in inputs), c_int(vocab),
                            c_long_long(logits.stride(0))),
                           shared_mem=0, stream=self._stream(logits.device))

    def greedy(self, logits: torch.Tensor, tokens: torch.Tensor, log_probs: torch.Tensor) -> None:
        """logits float32 [R, V] -> tokens int64 [R] (first maximum), log_probs float32 [R]."""
        self._logits("logits", logits)
        self._vectors(logits.shape[0], torch.int64, tokens=tokens)
        self._vectors(logits.shape[0], torch.float32, log_probs=log_probs)
        self._per_row("greedy_tokens", logits, (tokens, log_probs))

    def log_softmax(self, logits: torch.Tensor, out: torch.Tensor) -> None:
        """logits float32 [R, V] -> out float32 [R, V] (contiguous)."""
        self._logits("logits", logits)
        self._check("out", out, torch.float32, 2)
        assert out.shape == logits.shape and out.is_contiguous()
        self._per_row("log_softmax_rows", logits, (out,))

    def sample(self, logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor,
               normalize: torch.Tensor, tokens: torch.Tensor, log_probs: torch.Tensor) -> None:
        """logits float32 [R, V]; top_k int64, top_p float32, uniforms float32, normalize bool [R] ->
        tokens int64 [R], log_probs float32 [R]."""
        num_rows = logits.shape[0]
        self._logits("logits", logits)
        self._vectors(num_rows, torch.int64, top_k=top_k, tokens=tokens)
        self._vectors(num_rows, torch.float32, top_p=top_p, uniforms=uniforms, log_probs=log_probs)
        self._vectors(num_rows, torch.bool, normalize=normalize)
        self._per_row("sample_tokens", logits, (tokens, log_probs), (top_k, top_p, uniforms, normalize))

    def apply_token_bitmask(self, logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
        """logits float32 [R, V] in place: rows int64 [n], bitmask int32 [n, words >= ceil(V / 32)] (contiguous)."""
        self._logits("logits", logits)
        n, vocab = rows.shape[0], logits.shape[1]
        self._vectors(n, torch.int64, rows=rows)
        self._check("bitmask", bitmask, torch.int32, 2)
        assert bitmask.shape[0] == n and bitmask.shape[1] * 32 >= vocab and bitmask.is_contiguous(), \
            f"bitmask: shape {list(bitmask.shape)} for {n} rows of {vocab} tokens"
        if n and vocab:
            self._kernel("apply_token_bitmask")(
                (n,), (decoding_block(vocab, self.config),),
                (c_ptr(logits), c_ptr(rows), c_ptr(bitmask), c_int(bitmask.shape[1]), c_int(vocab),
                 c_long_long(logits.stride(0))), shared_mem=0, stream=self._stream(logits.device))

    def apply_min_p(self, logits: torch.Tensor, rows: torch.Tensor, min_p: torch.Tensor) -> None:
        """logits float32 [R, V] in place: rows int64 [n], min_p float32 [n]."""
        self._logits("logits", logits)
        n, vocab = rows.shape[0], logits.shape[1]
        self._vectors(n, torch.int64, rows=rows)
        self._vectors(n, torch.float32, min_p=min_p)
        if n and vocab:
            self._kernel("apply_min_p")(
                (n,), (decoding_block(vocab, self.config),),
                (c_ptr(logits), c_ptr(rows), c_ptr(min_p), c_int(vocab), c_long_long(logits.stride(0))),
                shared_mem=0, stream=self._stream(logits.device))

    def top_log_probs(self, logits: torch.Tensor, k: int, values: torch.Tensor, ids: torch.Tensor) -> None:
        """logits float32 [R, V] -> values float32 [R, k], ids int64 [R, k] (contiguous), 1 <= k <= V."""
        self._logits("logits", logits)
        num_rows, vocab = logits.shape
        assert 1 <= k <= vocab, f"k: {k} outside [1, {vocab}]"
        self._check("values", values, torch.float32, 2)
        self._check("ids", ids, torch.int64, 2)
        assert values.shape == ids.shape == (num_rows, k) and values.is_contiguous() and ids.is_contiguous()
        if num_rows:
            self._kernel("top_log_probs")(
                (num_rows,), (decoding_block(vocab, self.config),),
                (c_ptr(values), c_ptr(ids), c_ptr(logits), c_int(k), c_int(vocab), c_long_long(logits.stride(0))),
                shared_mem=0, stream=self._stream(logits.device))

    def beam_candidates(self, log_probs: torch.Tensor, running_scores: torch.Tensor, num_candidates: int,
                        diversity_rate: float, scores: torch.Tensor, parents: torch.Tensor,
                        tokens: torch.Tensor) -> None:
        """log_probs float32 [K, V] (contiguous), running_scores float32 [K] -> the num_candidates
        (<= K * V) best: scores float32, parents int64, tokens int64 [num_candidates], best first."""
        self._check("log_probs", log_probs, torch.float32, 2)
        assert log_probs.is_contiguous(), "log_probs: must be contiguous"
        num_beams, vocab = log_probs.shape
        self._vectors(num_beams, torch.float32, running_scores=running_scores)
        assert 0 <= num_candidates <= num_beams * vocab, (num_candidates, num_beams, vocab)
        self._vectors(num_candidates, torch.float32, scores=scores)
        self._vectors(num_candidates, torch.int64, parents=parents, tokens=tokens)
        if num_candidates == 0:
            return
        per_beam = min(num_candidates, vocab)
        # NOTE: freed on return; safe, torch's allocator is ordered on this stream
        cand_scores = torch.empty(num_beams, per_beam, dtype=torch.float32, device=log_probs.device)
        cand_tokens = torch.empty(num_beams, per_beam, dtype=torch.int32, device=log_probs.device)
        stream = self._stream(log_probs.device)
        self._kernel("beam_topk_per_beam")(
            (num_beams,), (decoding_block(vocab, self.config),),
            (c_ptr(cand_scores), c_ptr(cand_tokens), c_ptr(log_probs), c_ptr(running_scores), c_int(vocab),
             c_int(per_beam)), shared_mem=0, stream=stream)
        self._kernel("beam_select")(
            (1,), (decoding_block(num_beams * per_beam, self.config),),
            (c_ptr(scores), c_ptr(parents), c_ptr(tokens), c_ptr(cand_scores), c_ptr(cand_tokens), c_int(num_beams),
             c_int(per_beam), c_int(num_candidates), c_float(diversity_rate)), shared_mem=0, stream=stream)
