"""The `cuda` kernel backend: the raw CUDA sources of cuda_src/ compiled through CuPy's RawModule
(NVRTC) and launched on torch's current stream with pointers to torch tensors.

`CudaKernels` implements every op of interface.KernelBackend itself. The ops with no kernel run
on the torch backend held as `_reference`, on the same device tensors, by a declared call in
each op's body: repeat_ngram_bans and top_k_top_p_mask (host-side), dense_attention and
context_attention (see the NOTE below), and the dense math (prepared linears, RMSNorm, silu * up:
torch's GEMMs and elementwise ops on a GPU; on CPU tensors, the emu backend's or a fallback
runner's, the torch backend's CPU fast paths, so a model on the CPU computes the same dense math
whichever backend attends). The emu backend subclasses it and swaps only the module loader, the
device and the stream (that is the intended seam), so both run the same launchers (launchers.py)
and the same ops.

Compilation: every module (one per source file and storage dtype) compiles when the backend is
constructed, i.e. at engine start, never in a request's latency. CuPy keeps compiled cubins in its
on-disk kernel cache: CUPY_CACHE_DIR (default ~/.cupy/kernel_cache), keyed by the full source
string (prelude inlined, defines included), the options and the NVRTC version, so a warm start
only loads modules.

NOTE: stop criteria (end id, stop words, max length) have no kernel: the sampled tokens go to the
host for the responses anyway, and runtime/decoding/decoder.py checks them there. The decoding modules do
not depend on the storage dtype (float32 logits); they are built per dtype like every module and
launched from the first compiled one.

NOTE: context attention over cached blocks (chunked context, reused prefixes) stays on torch
(gather + scaled_dot_product_attention with a bottom-right causal / window mask). It runs once
per context chunk rather than once per token, torch's fused SDPA kernels already serve it well,
and a raw paged prefill kernel (FlashAttention-style tiling over blocks) is a large kernel of its
own for a small share of step time.
"""
from __future__ import annotations

import logging
import operator

import torch

from ... import rng
from . import sources
from .decoding_launchers import DecodingLaunchers
from .launchers import DTYPE_CODES, KvLaunchers, LaunchConfig
from ..torch_kernels.torch_backend import TorchKernels

logger = logging.getLogger(__name__)

NVRTC_OPTIONS = ("-std=c++17",)


def import_cupy():
    """The one place CuPy is imported (lazily: `import runtime` must work without it)."""
    import cupy
    return cupy


def cuda_available() -> bool:
    """True when a CUDA device is visible to torch and CuPy imports."""
    if not torch.cuda.is_available():
        return False
    try:
        import_cupy()
    except Exception:  # noqa: BLE001 - any import failure means the backend is unavailable
        return False
    return True


class CudaKernels:
    name = "cuda"
    kv_storage_dtypes = frozenset({*DTYPE_CODES, torch.int8})   # the compiled dtypes, and int8 with scales
    device_type = "cuda"

    def __init__(self, config: LaunchConfig | None = None, cpu_fallback: bool = False,
                 dtypes: tuple[torch.dtype, ...] = tuple(DTYPE_CODES)):
        """cpu_fallback: route CPU tensors to the torch reference (set when this backend was picked
        by default, so a runner on the CPU of a GPU machine keeps working). dtypes: the storage
        dtypes to compile modules for (all by default)."""
        unknown = [d for d in dtypes if d not in DTYPE_CODES]
        if unknown:
            raise ValueError(f"dtypes: unsupported {unknown}; supported {list(DTYPE_CODES)}")
        self.config = config or self.default_config()
        self.cpu_fallback = cpu_fallback
        self._reference = TorchKernels(fast_paths=True)  # the ops without a kernel; CPU tensors on fallback
        self.dtypes = tuple(dtypes)
        self._functions = self._compile_all()
        self.launchers = KvLaunchers(self.function, self.device_type, self._stream, self.config)
        self.decoding = DecodingLaunchers(self.function, self.device_type, self._stream, self.config, self.dtypes[0])

    @staticmethod
    def default_config() -> LaunchConfig:
        return LaunchConfig()

    # ---- module loading (overridden by the emu backend) -----------------------------------------
    def _compile_all(self) -> dict[tuple[torch.dtype, str], object]:
        cupy = import_cupy()
        functions = {}
        for source, kernel_names in sources.KERNEL_SOURCES.items():
            for dtype in self.dtypes:
                code = sources.program(source, self.config.defines(dtype))
                module = cupy.RawModule(code=code, options=NVRTC_OPTIONS)
                for name in kernel_names:  # the first get_function compiles and loads the module
                    functions[dtype, name] = _OnStreamDevice(module.get_function(name))
        logger.info("cuda kernels: %d functions compiled (CuPy cache CUPY_CACHE_DIR)", len(functions))
        return functions

    def function(self, dtype: torch.dtype, name: str):
        function = self._functions.get((dtype, name))
        if function is None:
            raise ValueError(f"{self.name} kernels: no {name} module for dtype {dtype} (compiled: {list(self.dtypes)})")
        return function

    def _stream(self, device: torch.device):
        """torch's current stream on `device`, fetched at every launch (graph capture switches it)."""
        stream = torch.cuda.current_stream(device)
        return import_cupy().cuda.ExternalStream(stream.cuda_stream, stream.device.index)

    def _use_reference(self, t: torch.Tensor) -> bool:
        return self.cpu_fallback and t.device.type == "cpu"

    # ---- ops --------------------------------------------------------------------------------------
    def write_kv(self, k_cache, v_cache, k, v, slot_mapping, k_scales=None, v_scales=None) -> None:
        if self._use_reference(k_cache):
            return self._reference.write_kv(k_cache, v_cache, k, v, slot_mapping, k_scales, v_scales)
        if k_scales is not None:   # int8 cache: the rows stay in their compute dtype, quantized in the kernel
            _check_int8_cache(k_cache)
            self.launchers.write_kv(k_cache, v_cache, _rows_contiguous(k), _rows_contiguous(v.to(k.dtype)),
                                    slot_mapping.to(torch.int64).contiguous(), k_scales, v_scales)
            return
        self.launchers.write_kv(k_cache, v_cache, _rows_contiguous(k.to(k_cache.dtype)),
                                _rows_contiguous(v.to(v_cache.dtype)), slot_mapping.to(torch.int64).contiguous())

    def copy_blocks(self, kv_pool, src_block_ids, dst_block_ids) -> None:
        if self._use_reference(kv_pool):
            return self._reference.copy_blocks(kv_pool, src_block_ids, dst_block_ids)
        self.launchers.copy_blocks(self._as_compiled_dtype(kv_pool), src_block_ids.to(torch.int64).contiguous(),
                                   dst_block_ids.to(torch.int64).contiguous())

    def _as_compiled_dtype(self, pool: torch.Tensor) -> torch.Tensor:
        """The pool as a view in a compiled storage dtype of the same bytes (copy_blocks only moves
        them): an int8 pool or a float32 scale pool on a backend compiled for other dtypes."""
        if pool.dtype in self.dtypes:
            return pool
        row_bytes = pool.shape[-1] * pool.element_size()
        for dtype in self.dtypes:
            if row_bytes % dtype.itemsize == 0 and pool.is_contiguous():
                return pool.view(dtype)
        raise ValueError(f"copy_blocks: a {pool.dtype} pool with rows of {row_bytes} bytes has no view in the "
                         f"compiled dtypes {list(self.dtypes)}")

    def decode_attention(self, q, k_cache, v_cache, block_tables, seq_lens, scale, window, sink=0, alibi_slopes=None,
                         k_scales=None, v_scales=None):
        if self._use_reference(q):
            return self._reference.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, window, sink,
                                                    alibi_slopes, k_scales, v_scales)
        if window is not None and (_as_int(window) is None or window <= 0):
            raise ValueError(f"window: must be None or a positive int, got {window!r}")
        if _as_int(sink) is None or sink < 0:
            raise ValueError(f"sink: must be a non-negative int, got {sink!r}")
        if k_scales is not None:
            _check_int8_cache(k_cache)
        elif q.dtype != k_cache.dtype:
            raise ValueError(f"q: dtype {q.dtype} differs from the cache's {k_cache.dtype}")
        if alibi_slopes is not None:
            if alibi_slopes.shape != (q.shape[1],):
                raise ValueError(f"alibi_slopes: expected one slope per query head, shape [{q.shape[1]}], got "
                                 f"{list(alibi_slopes.shape)}")
            alibi_slopes = alibi_slopes.to(q.device, torch.float32).contiguous()
        q = q.contiguous()
        out = torch.empty_like(q)
        self.launchers.decode_attention(out, q, k_cache, v_cache, block_tables.to(torch.int32).contiguous(),
                                        seq_lens.to(torch.int32).contiguous(), scale, _as_int(window or 0),
                                        _as_int(sink), alibi_slopes, k_scales, v_scales)
        return out

    def context_attention(self, q, k_cache, v_cache, block_table, past_len, scale, window, sink=0, alibi_slopes=None,
                          k_scales=None, v_scales=None):
        return self._reference.context_attention(q, k_cache, v_cache, block_table, past_len, scale, window, sink,
                                                 alibi_slopes, k_scales, v_scales)

    def dense_attention(self, q, k, v, past_len, scale, window, sink=0, alibi_slopes=None):
        return self._reference.dense_attention(q, k, v, past_len, scale, window, sink, alibi_slopes)

    # ---- dense math: torch's, through the torch backend (see the module docstring) ------------------
    def prepare_linear(self, weight, bias, impl=None):
        return self._reference.prepare_linear(weight, bias, impl)

    def prepare_weight_only_linear(self, weight, scale, minimum, bias, act_quant=None):
        return self._reference.prepare_weight_only_linear(weight, scale, minimum, bias, act_quant)

    def prepare_block_linear(self, segments, bias):
        return self._reference.prepare_block_linear(segments, bias)

    def prepare_decode_step(self, model, kv_pool, kv_scales, tokens_per_block):
        return None   # the GPU runs the model op by op

    def linear(self, x, weight):
        return self._reference.linear(x, weight)

    def linear_add(self, x, weight, residual):
        return self._reference.linear_add(x, weight, residual)

    def rms_norm(self, x, weight, eps):
        return self._reference.rms_norm(x, weight, eps)

    def silu_mul(self, x):
        return self._reference.silu_mul(x)

    # ---- decoding ops: float32 logits (see cuda_src/sampling.cu for the algorithms) ------------------
    def uniforms(self, seeds, steps, beams):
        if self._use_reference(seeds):
            return self._reference.uniforms(seeds, steps, beams)
        out = torch.empty(seeds.shape[0], dtype=torch.float32, device=seeds.device)
        self.decoding.uniforms(out, _int64(seeds), _int64(steps), _int64(beams), rng.LANE_SAMPLE)
        return out

    def apply_penalties(self, logits, rows, token_ids, token_lengths, embedding_bias, temperature,
                        repetition_penalty, presence_penalty, frequency_penalty, min_lengths, num_generated,
                        end_ids) -> None:
        if self._use_reference(logits):
            return self._reference.apply_penalties(logits, rows, token_ids, token_lengths, embedding_bias,
                                                   temperature, repetition_penalty, presence_penalty,
                                                   frequency_penalty, min_lengths, num_generated, end_ids)
        _in_place(logits, lambda target: self.decoding.apply_penalties(
            target, _int64(rows), _int64(token_ids), _int64(token_lengths),
            None if embedding_bias is None else _float32(embedding_bias), _float32(temperature),
            _float32(repetition_penalty), _float32(presence_penalty), _float32(frequency_penalty),
            _int64(min_lengths), _int64(num_generated), _int64(end_ids)))

    def ban_tokens(self, logits, row_ids, token_ids) -> None:
        if self._use_reference(logits):
            return self._reference.ban_tokens(logits, row_ids, token_ids)
        _in_place(logits, lambda target: self.decoding.ban_tokens(target, _int64(row_ids), _int64(token_ids)))

    def repeat_ngram_bans(self, tokens, ngram_size):
        return self._reference.repeat_ngram_bans(tokens, ngram_size)

    def greedy(self, logits):
        if self._use_reference(logits):
            return self._reference.greedy(logits)
        logits, tokens, log_probs = _token_outputs(logits)
        self.decoding.greedy(logits, tokens, log_probs)
        return tokens, log_probs

    def log_softmax(self, logits):
        if self._use_reference(logits):
            return self._reference.log_softmax(logits)
        _check_logits(logits)
        rows = _columns_contiguous(logits)
        out = torch.empty(rows.shape, dtype=torch.float32, device=rows.device)
        self.decoding.log_softmax(rows, out)
        return out

    def top_k_top_p_mask(self, logits, top_k, top_p):
        return self._reference.top_k_top_p_mask(logits, top_k, top_p)

    def sample(self, logits, top_k, top_p, uniforms, normalize_log_probs):
        if self._use_reference(logits):
            return self._reference.sample(logits, top_k, top_p, uniforms, normalize_log_probs)
        logits, tokens, log_probs = _token_outputs(logits)
        self.decoding.sample(logits, _int64(top_k), _float32(top_p), _float32(uniforms),
                             normalize_log_probs.to(torch.bool).contiguous(), tokens, log_probs)
        return tokens, log_probs

    def apply_token_bitmask(self, logits, rows, bitmask) -> None:
        if self._use_reference(logits):
            return self._reference.apply_token_bitmask(logits, rows, bitmask)
        _in_place(logits, lambda target: self.decoding.apply_token_bitmask(
            target, _int64(rows), bitmask.to(target.device, torch.int32).contiguous()))

    def apply_min_p(self, logits, rows, min_p) -> None:
        if self._use_reference(logits):
            return self._reference.apply_min_p(logits, rows, min_p)
        _in_place(logits, lambda target: self.decoding.apply_min_p(target, _int64(rows), _float32(min_p)))

    def top_log_probs(self, logits, k):
        if self._use_reference(logits):
            return self._reference.top_log_probs(logits, k)
        _check_logits(logits)
        logits = _columns_contiguous(logits)
        values = torch.empty(logits.shape[0], k, dtype=torch.float32, device=logits.device)
        ids = torch.empty(logits.shape[0], k, dtype=torch.int64, device=logits.device)
        self.decoding.top_log_probs(logits, k, values, ids)
        return values, ids

    def beam_candidates(self, log_probs, running_scores, num_candidates, diversity_rate):
        if self._use_reference(log_probs):
            return self._reference.beam_candidates(log_probs, running_scores, num_candidates, diversity_rate)
        _check_logits(log_probs, "log_probs")
        num_beams, vocab = log_probs.shape
        num_candidates = min(int(num_candidates), num_beams * vocab)
        device = log_probs.device
        scores = torch.empty(num_candidates, dtype=torch.float32, device=device)
        parents = torch.empty(num_candidates, dtype=torch.int64, device=device)
        tokens = torch.empty(num_candidates, dtype=torch.int64, device=device)
        self.decoding.beam_candidates(log_probs.contiguous(), _float32(running_scores), num_candidates,
                                      float(diversity_rate), scores, parents, tokens)
        return scores, parents, tokens


class _OnStreamDevice:
    """A CuPy RawKernel launched with CuPy's current device set to the stream's device (CuPy picks
    the loaded module by its current device)."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        with import_cupy().cuda.Device(stream.device_id):
            self.kernel(grid, block, args, shared_mem=shared_mem, stream=stream)


def _check_int8_cache(k_cache: torch.Tensor) -> None:
    if k_cache.dtype != torch.int8:
        raise ValueError(f"k_cache: the {k_cache.dtype} cache has no kernel here; quantized caches are int8 "
                         "(fp8 runs on the torch backend)")


def _as_int(value) -> int | None:
    """An integral value (Python or numpy int) as int; None for anything else (floats, bools)."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _in_place(logits: torch.Tensor, launch) -> None:
    """Run an in-place logits kernel on a column-contiguous view of logits, copying back if needed."""
    _check_logits(logits)
    target = _columns_contiguous(logits)
    launch(target)
    if target is not logits:
        logits.copy_(target)


def _token_outputs(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(checked logits with contiguous columns, tokens int64 [R] and log_probs float32 [R] to fill)."""
    _check_logits(logits)
    rows = logits.shape[0]
    return (_columns_contiguous(logits), torch.empty(rows, dtype=torch.int64, device=logits.device),
            torch.empty(rows, dtype=torch.float32, device=logits.device))


def _int64(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int64).contiguous()


def _float32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32).contiguous()


def _check_logits(logits: torch.Tensor, name: str = "logits") -> None:
    if logits.dtype != torch.float32 or logits.dim() != 2:
        raise ValueError(f"{name}: the decoding kernels take float32 [rows, vocab], got {logits.dtype} "
                         f"{list(logits.shape)}")


def _columns_contiguous(t: torch.Tensor) -> torch.Tensor:
    """[R, V] with unit column stride (any row stride); a copy only when the columns are strided."""
    return t if t.stride(1) == 1 or t.shape[1] <= 1 else t.contiguous()


def _rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    """[T, kvH, D] with contiguous [kvH, D] rows (a view of a fused QKV qualifies as is)."""
    if t.dim() == 3 and t.stride(2) == 1 and (t.shape[1] == 1 or t.stride(1) == t.shape[2]):
        return t
    return t.contiguous()
