"""The generation step of a LLaMA-family model as one native call (decode_step.cpp): every
layer's RMSNorm, QKV, rotary, KV-cache write, paged decode attention, out-projection, gated MLP
and residuals, then the final norm and lm_head, inside one OpenMP parallel region.

Why: at one to a few sequences a step is a chain of ~15 small ops per layer; run from Python
(eager torch ops and one ctypes call each) they cost ~4.4 ms per token on SmolLM2-135M, as much
as its weight matmuls. The native step (decode_step.cpp, in the native CPU layer's one library)
calls the same functions as the per-op entry points: the linear ranges, RMSNorm, silu * up and the
paged decode attention, so the eager native path and the fused step compute the same numbers.

What it covers (`DecodeStep.build` says None otherwise; the eager model stays the reference and
the fallback): RMSNorm, Qwen3's per-head RMSNorm of queries and keys before rotary, rotary
positions with the neox pairing (partial rotary too; any scaling of the frequencies), the
sequential residual, a SiLU-gated MLP, biases on any linear; weights float32, bf16, int8 or int4
(exact, or with int8 activations: act_quant.py, each thread quantizing each GEMV input once), or
llama.cpp's blocks kept from a GGUF file (BlockLinear: one format per run of rows, each by its
format table kernel, as the eager path's bound block kernels compute it);
a float32, bf16 or int8 KV cache; one process (no tensor or pipeline parallelism), CPU. The runner
routes a step to it when every sequence has one new token, there are at most MAX_ROWS of them,
and nothing changes the forward (no LoRA, prompt tables, context logits or draft logits).

Numerics: activations stay float32 from the embedding to the logits (the eager model's in a
float32 engine; a bf16 engine's eager path rounds them to bf16 between ops, so there the two
agree to bf16 rounding). BATCH_MANAGER_FUSED_DECODE=0 (or false / off / no) turns it off (A/B runs, tests).
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os

import torch

from . import isa as isa_tiers, library as native_library
from ...quantization.native_codes import input_code, kv_code, weight_code
from .blocks import BoundLinear, input_type as _input_type
from ..torch_kernels.block_linear import BlockLinear
from ..torch_kernels.linear import Linear
from ..torch_kernels.weight_only_linear import QuantizedLinear

logger = logging.getLogger(__name__)

ENV_VAR = "BATCH_MANAGER_FUSED_DECODE"   # off (0/false/off/no): generation steps take the eager path
_SWITCH_VALUES = {"0": False, "false": False, "off": False, "no": False, "1": True, "true": True, "on": True, "yes": True}
# Sequences per fused step: the GEMVs reuse each weight load across the rows of a small batch; above
# this many rows the eager path's blocked GEMMs (oneDNN, de-quantized tiles) are the better kernels.
MAX_ROWS = 8
# The rotary tables' first size, positions (then doubled as steps need): 64 KiB at 32 frequencies.
MIN_ROPE_POSITIONS = 256

# Codes of the native format table (runtime.quantization.native_codes): float weights (a quantized
# one's: its WeightFormat.native_code), the input types of the dot kernels, the KV caches.
_FORMATS = {torch.float32: weight_code("float32"), torch.bfloat16: weight_code("bf16")}
_INPUT_FLOAT32, _INPUT_Q8X32 = input_code("float32"), input_code("q8x32")
_KV_FORMATS = {torch.float32: kv_code("float32"), torch.bfloat16: kv_code("bf16"), torch.int8: kv_code("int8")}
_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


class _Segment(ctypes.Structure):
    _fields_ = [("format", _I32), ("x8", _I32), ("w", _P), ("first", _I64), ("last", _I64), ("row_bytes", _I64)]


class _Linear(ctypes.Structure):
    _fields_ = [("format", _I32), ("input", _I32), ("w", _P), ("scale", _P), ("min", _P), ("bias", _P),
                ("n", _I64), ("k", _I64), ("gs", _I64), ("segments", _P), ("num_segments", _I64)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("qkv", _Linear), ("out", _Linear), ("mlp_in", _Linear),
                ("mlp_out", _Linear), ("k_cache", _P), ("v_cache", _P), ("k_scales", _P), ("v_scales", _P),
                ("q_norm", _P), ("k_norm", _P)]


class _Model(ctypes.Structure):
    _fields_ = [("num_layers", _I64), ("hidden", _I64), ("num_heads", _I64), ("num_kv_heads", _I64),
                ("head_dim", _I64), ("intermediate", _I64), ("vocab", _I64), ("rotary_dim", _I64),
                ("tokens_per_block", _I64), ("window", _I64), ("sink", _I64), ("rope_positions", _I64),
                ("eps", _F32), ("attention_scale", _F32), ("kv_format", _I32), ("isa", _I32),
                ("matmuls_only", _I32), ("pad", _I32),
                ("rope_cos", _P), ("rope_sin", _P), ("final_norm", _P), ("layers", _P), ("lm_head", _Linear)]


def enabled() -> bool:
    """BATCH_MANAGER_FUSED_DECODE: unset or empty: on; 0/false/off/no or 1/true/on/yes in any case;
    ValueError naming the variable for anything else."""
    value = os.environ.get(ENV_VAR, "")
    if not value.strip():
        return True
    switch = _SWITCH_VALUES.get(value.strip().lower())
    if switch is None:
        raise ValueError(f"{ENV_VAR}: expected 0/false/off/no or 1/true/on/yes, got {value!r}")
    return switch


def openmp_runtimes() -> set[str]:
    """The OpenMP runtime libraries mapped into this process (libgomp, LLVM's libomp, Intel's
    libiomp5), by path. One is expected: the step's region then runs on torch's own thread pool.
    Two would mean two thread teams spinning on the same cores (a 10-100x slowdown is reported
    for mixing libgomp and libomp)."""
    names = ("libgomp", "libomp", "libiomp5")
    try:
        with open("/proc/self/maps") as f:
            return {line.split()[-1] for line in f
                    if len(line.split()) >= 6 and os.path.basename(line.split()[-1]).startswith(names)}
    except OSError:
        return set()


@functools.lru_cache(maxsize=None)
def _one_openmp_runtime() -> bool:
    """Checked once per process, after the library is loaded."""
    runtimes = openmp_runtimes()
    if len(runtimes) > 1:
        logger.warning("fused decode step: off, %d OpenMP runtimes are mapped in this process (%s); the "
                       "native kernels need the one torch uses", len(runtimes), ", ".join(sorted(runtimes)))
        return False
    return True


def library() -> ctypes.CDLL | None:
    """The native CPU layer's library (library.load()), whose bm_decode_step this binds; None where
    it cannot be built or run here."""
    return native_library.load()


def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().float().contiguous()


class DecodeStep:
    """A model's generation step bound to its weights and KV pool (pointers taken once: the model,
    the pool and the tensors made here must outlive it; the runner holds all three)."""

    max_rows = MAX_ROWS

    def __init__(self, lib: ctypes.CDLL, model, kv_pool: torch.Tensor, kv_scales: torch.Tensor | None,
                 tokens_per_block: int, isa: int):
        cfg = model.config
        self._lib, self._model = lib, model
        self._keep: list = []   # float32 copies of norms and biases, segment arrays: what the structs point at
        layers = (_Layer * cfg.num_layers)()
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            layer = layers[i]
            layer.input_norm = self._hold(_f32(model.w[p + "input_norm.weight"]))
            layer.post_norm = self._hold(_f32(model.w[p + "post_norm.weight"]))
            if cfg.qk_norm:
                layer.q_norm = self._hold(_f32(model.w[p + "q_norm.weight"]))
                layer.k_norm = self._hold(_f32(model.w[p + "k_norm.weight"]))
            for field, name in (("qkv", "qkv"), ("out", "out"), ("mlp_in", "mlp_in"), ("mlp_out", "mlp_out")):
                setattr(layer, field, self._linear(model.linears[p + name]))
            layer.k_cache, layer.v_cache = kv_pool[i, 0].data_ptr(), kv_pool[i, 1].data_ptr()
            if kv_scales is not None:
                layer.k_scales, layer.v_scales = kv_scales[i, 0].data_ptr(), kv_scales[i, 1].data_ptr()
        self._layers = layers
        window = model.attention_window
        self._struct = _Model(
            num_layers=cfg.num_layers, hidden=cfg.hidden_size, num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, intermediate=cfg.intermediate_size,
            vocab=cfg.vocab_size, rotary_dim=cfg.rotary_dim, tokens_per_block=tokens_per_block,
            window=-1 if window is None else window, sink=model.sink_token_length, rope_positions=0,
            eps=cfg.norm_eps, attention_scale=model.scale, kv_format=_KV_FORMATS[kv_pool.dtype], isa=isa,
            final_norm=self._hold(_f32(model.w["final_norm.weight"])), layers=ctypes.addressof(layers),
            lm_head=self._linear(model.lm_head))
        # The rotary tables start empty and grow by doubling as steps reach further positions
        # (_ensure_positions): computed up front for 4096 positions they held 1 MiB (SmolLM2) in
        # every serving process, a fifth of what it held beside its weights and KV cache.
        self._rope_cos = self._rope_sin = None

    @classmethod
    def build(cls, model, kv_pool: torch.Tensor, kv_scales: torch.Tensor | None, tokens_per_block: int
              ) -> "DecodeStep | None":
        """The fused step of `model` (runtime.models.transformer.Transformer) over its pool, or None
        where the model, its weights or this machine are outside what it covers (module docstring)."""
        cfg = model.config
        if (not enabled() or model.device.type != "cpu" or model.tp is not None or model.shard is not None
                or not model.is_first_stage or not model.is_last_stage or cfg.norm_type != "rmsnorm"
                or cfg.mlp_type != "gated" or cfg.activation not in ("silu", "swish")
                or cfg.position_embedding != "rope" or cfg.rotary_style != "neox" or cfg.residual != "sequential"
                or cfg.embedding_norm or model.alibi_slopes is not None or kv_pool.dtype not in _KV_FORMATS
                or model.dtype not in (torch.float32, torch.bfloat16)):
            return None
        prepared = [model.lm_head] + list(model.linears.values())
        if not all(_format(linear) is not None for linear in prepared):
            return None
        lib = library()
        if lib is None or not _one_openmp_runtime():
            return None
        return cls(lib, model, kv_pool, kv_scales, tokens_per_block, int(isa_tiers.cap()))

    @property
    def matmuls_only(self) -> int:
        """Benchmarks (outputs then meaningless): 1 runs the weight GEMVs alone, 2 all but attention;
        0 (the default) the whole step."""
        return self._struct.matmuls_only

    @matmuls_only.setter
    def matmuls_only(self, value: int) -> None:
        if value not in (0, 1, 2):
            raise ValueError(f"matmuls_only: expected 0, 1 or 2, got {value!r}")
        self._struct.matmuls_only = int(value)

    def _hold(self, t: torch.Tensor | None) -> int | None:
        if t is None:
            return None
        self._keep.append(t)
        return t.data_ptr()

    def _linear(self, linear) -> _Linear:
        fmt, input_type = _format(linear)
        if isinstance(linear, BlockLinear):
            segments = (_Segment * len(linear.segments))()
            for segment, kernel, (block_format, blocks, first, last) in zip(segments, linear.kernels,
                                                                             linear.segments):
                segment.format, segment.x8 = weight_code(block_format.name), int(kernel.layout == "x8")
                segment.w, segment.first, segment.last = blocks.data_ptr(), first, last
                segment.row_bytes = blocks.shape[1]
            self._keep.append(segments)
            return _Linear(format=fmt, input=input_type, bias=self._hold(linear.bias_f32), n=linear.num_outputs,
                           k=linear.in_features, segments=ctypes.addressof(segments),
                           num_segments=len(linear.segments))
        if isinstance(linear, QuantizedLinear) and linear.act_kernel is not None:
            packed = linear.packed
            return _Linear(format=fmt, input=input_type, w=packed.packed.data_ptr(),
                           scale=packed.scale.data_ptr(),
                           min=None if packed.minimum is None else packed.minimum.data_ptr(),
                           bias=self._hold(linear.bias_f32), n=packed.n, k=packed.k, gs=packed.group_size)
        if isinstance(linear, QuantizedLinear):
            n, k = linear.weight.shape[0], linear.format.input_width(linear.weight)
            gs = k // linear.scale.shape[1] if linear.format.is_grouped else 0
            return _Linear(format=fmt, input=input_type, w=linear.weight.data_ptr(), scale=linear.scale.data_ptr(),
                           min=None if linear.minimum is None else linear.minimum.data_ptr(),
                           bias=self._hold(linear.bias_f32), n=n, k=k, gs=gs)
        n, k = linear.plain.shape
        return _Linear(format=fmt, input=input_type, w=linear.plain.data_ptr(), bias=self._hold(_f32(linear.bias)),
                       n=n, k=k)

    def _ensure_positions(self, num_positions: int) -> None:
        """Rotary tables cover positions [0, num_positions) (grown by doubling as steps need),
        computed as the eager model computes its cos / sin (rope.rope_cos_sin, float32)."""
        if self._struct.rope_positions >= num_positions:
            return
        size = max(num_positions, 2 * self._struct.rope_positions, MIN_ROPE_POSITIONS)
        freqs = torch.arange(size, dtype=torch.float32)[:, None] * self._model.inv_freq.float()[None, :]
        self._rope_cos, self._rope_sin = freqs.cos().contiguous(), freqs.sin().contiguous()
        self._struct.rope_cos, self._struct.rope_sin = self._rope_cos.data_ptr(), self._rope_sin.data_ptr()
        self._struct.rope_positions = size

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """input_ids, positions, slots, seq_lens int64 [rows] (checked by the caller: ids in the
        vocabulary, positions >= 0, every block read in the pool), block_tables int32 [rows, width]
        -> logits float32 [rows, vocab]. Writes each sequence's new K / V into its slot."""
        rows = input_ids.numel()
        assert 1 <= rows <= self.max_rows and block_tables.dtype == torch.int32 and block_tables.is_contiguous()
        self._ensure_positions(int(positions.max()) + 1)
        x = self._model._embed(input_ids).to(torch.float32).contiguous()   # a new tensor: the step writes it
        logits = torch.empty(rows, self._struct.vocab, dtype=torch.float32)
        self._lib.bm_decode_step(ctypes.addressof(self._struct), rows, x.data_ptr(), positions.data_ptr(),
                                 slots.data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
                                 seq_lens.data_ptr(), logits.data_ptr(), torch.get_num_threads())
        return logits


def _format(linear) -> tuple[int, int] | None:
    """(weight format code, input type code) of a prepared linear the fused step can read in place,
    else None. int8 activations are the q8x32 input type of the int8 / int4 dot kernels. Block
    weights: their first segment's (each segment carries its own), where their native kernels are
    bound (this library's BoundLinear) and every segment starts on a thread unit (decode_step.cpp's kUnit = 32 outputs)."""
    if isinstance(linear, BlockLinear):
        if (linear.kernels is None or not all(isinstance(kernel, BoundLinear) for kernel in linear.kernels)
                or any(first % 32 for _, _, first, _ in linear.segments)):
            return None
        block_format = linear.segments[0][0]
        return weight_code(block_format.name), input_code(_input_type(block_format.name))
    if isinstance(linear, QuantizedLinear) and linear.act_quant is not None:
        return None if linear.act_kernel is None else (linear.format.native_code, _INPUT_Q8X32)
    if isinstance(linear, QuantizedLinear):   # its kernel was bound: the group size is one the kernels run
        return None if linear.kernel is None else (linear.format.native_code, _INPUT_FLOAT32)
    if isinstance(linear, Linear) and linear.plain is not None and linear.plain.dtype in _FORMATS:
        return _FORMATS[linear.plain.dtype], _INPUT_FLOAT32
    return None
