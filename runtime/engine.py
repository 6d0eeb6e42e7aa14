"""Engine directories: load (engine dir, HF checkpoint dir or GGUF file) and save (the build step).

An engine directory holds `engine.json` ({"format", "version", "model": ModelConfig,
"build": BuildConfig}, and "weight_formats" where weights are kept in GGUF block formats) and
`weights.safetensors` with the canonical weight names in the build dtype (a weight-only build: the
quantized matmul weights and their parts, runtime.quantization; kept blocks: each weight's row
segments, runtime.quantization.block_weights, their formats recorded in "weight_formats").
An HF checkpoint directory (`config.json` + safetensors), a `.gguf` file or a directory holding
exactly one (runtime.loading.gguf_checkpoint) is accepted wherever an engine directory is; its
limits then come from `default_build_config` plus any overrides.
"""
from __future__ import annotations

import dataclasses
import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch
from safetensors.torch import save_file

from .config import BuildConfig, ConfigError, ModelConfig, default_build_config, read_json
from .kernels.kv_quant import KV_STORAGE_DTYPES, is_quantized_kv
from .models import lookup_hf, model_config_from_dict
from .precision import QuantMode, resolve_dtype
from .parallel.pipeline import StageLayers, StagePlan
from .parallel.tensor_shard import TensorShard, num_local_kv_heads
from .quantization import lookup_build
from .quantization.block_weights import dequantize_segments, is_segment, stored_block_layout, weight_formats
from .quantization.stored import quantize_weights, stored_layout
from .loading.weights import Weights, check_weights, expected_shapes, load_engine_weights, load_hf_weights

if TYPE_CHECKING:
    from .loading.gguf_checkpoint import GgufCheckpoint

ENGINE_CONFIG_FILE = "engine.json"
ENGINE_WEIGHTS_FILE = "weights.safetensors"
ENGINE_FORMAT = "batch-manager-engine"
ENGINE_VERSION = 1
T = TypeVar("T")

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class Engine:
    model_config: ModelConfig
    build_config: BuildConfig
    weights: Weights
    source_dir: str
    # Set when `weights` hold one rank's slices (tensor parallelism); None: every weight whole.
    shard: TensorShard | None = None
    # Tensor bytes from_dir read from the safetensors files (a rank: about its share of them).
    num_bytes_read: int = 0
    # Set when `weights` hold one pipeline stage's layers (pipeline parallelism); None: every layer.
    stage: StageLayers | None = None

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (BuildConfig.dtype as resolved on this machine)."""
        return TORCH_DTYPES[self.model_config.dtype]

    def weight_bytes(self) -> int:
        """Bytes of every weight tensor held (quantized ones with their scales)."""
        return sum(t.numel() * t.element_size() for t in self.weights.values())

    @property
    def kv_storage_dtype(self) -> torch.dtype:
        """The KV pool's element dtype: the compute dtype ("auto"), int8 or float8 e4m3."""
        return KV_STORAGE_DTYPES.get(self.build_config.kv_cache_dtype, self.dtype)

    def kv_bytes_per_token(self, tensor_parallelism: int = 1, num_layers: int | None = None) -> int:
        """KV cache bytes one token takes across `num_layers` layers (default: all; a pipeline
        stage: its own), on one of `tensor_parallelism` ranks (its KV heads): the values and, for a
        quantized cache, their float32 scales (one per token, head, K and V)."""
        cfg = self.model_config
        dtype = self.kv_storage_dtype
        row_bytes = cfg.head_dim * dtype.itemsize + (4 if is_quantized_kv(dtype) else 0)
        num_layers = cfg.num_layers if num_layers is None else num_layers
        return num_layers * 2 * num_local_kv_heads(cfg.num_kv_heads, tensor_parallelism) * row_bytes

    @staticmethod
    def from_dir(path: str | os.PathLike, shard: TensorShard | tuple[int, int] | None = None,
                 stage: StagePlan | None = None, **build_overrides) -> "Engine":
        """Load an engine directory, an HF checkpoint directory or a GGUF file (or a directory holding
        exactly one, and neither engine.json nor config.json).

        `shard`: read only that rank's slices of the weights: a TensorShard (ValueError when it
        was made for another model), or (rank, size) for TensorShard.of(model_config, rank, size).
        `stage`: read only that pipeline stage's layers (runtime.parallel.pipeline). `build_overrides` (BuildConfig
        fields) replace the recorded limits; for an HF directory or a GGUF file they replace the
        defaults of `default_build_config`.
        """
        directory = os.fspath(path)
        gguf_path = _gguf_source(directory)
        if gguf_path is not None:
            from .loading.gguf_checkpoint import GgufCheckpoint   # NOTE: lazy, only GGUF loading needs the gguf package
            with GgufCheckpoint(gguf_path) as checkpoint:
                return _load_gguf(checkpoint, directory, build_overrides, shard, stage)
        if not os.path.isdir(directory):
            raise ConfigError(f"engine_dir: not a directory or a .gguf file: {directory!r}")
        if os.path.exists(os.path.join(directory, ENGINE_CONFIG_FILE)):
            return _load_engine_dir(directory, build_overrides, shard, stage)
        if os.path.exists(os.path.join(directory, "config.json")):
            return _load_hf_dir(directory, build_overrides, shard, stage)
        raise ConfigError(f"engine_dir: {directory!r} holds neither {ENGINE_CONFIG_FILE} (an engine), "
                          "config.json (a Hugging Face checkpoint) nor a .gguf file")

    def save(self, directory: str | os.PathLike) -> None:
        if self.shard is not None or self.stage is not None:
            raise ValueError("Engine.save: the weights are one rank's slices or one stage's layers; only a whole "
                             "engine can be saved")
        directory = os.fspath(directory)
        os.makedirs(directory, exist_ok=True)
        tensors = {name: t.contiguous() for name, t in self.weights.items()}
        save_file(tensors, os.path.join(directory, ENGINE_WEIGHTS_FILE), metadata={"format": ENGINE_FORMAT})
        config = {"format": ENGINE_FORMAT, "version": ENGINE_VERSION,
                  "model": self.model_config.to_dict(), "build": self.build_config.to_dict()}
        formats = weight_formats({name: tuple(t.shape) for name, t in self.weights.items()})
        if formats:
            config["weight_formats"] = formats
        with open(os.path.join(directory, ENGINE_CONFIG_FILE), "w") as f:
            json.dump(config, f, indent=2)


def _checked_shard(shard: TensorShard | tuple[int, int] | None, model: ModelConfig,
                   build: BuildConfig | None = None) -> TensorShard | None:
    if isinstance(shard, tuple):
        shard = TensorShard.of(model, *shard)
    if shard is not None and shard != TensorShard.of(model, shard.rank, shard.size):
        raise ValueError(f"shard: {shard} was not made for this model (expected "
                         f"{TensorShard.of(model, shard.rank, shard.size)})")
    if shard is not None and build is not None and build.weight_only is not None:
        shard.check_weight_format(lookup_build(build.weight_only), build.group_size)
    return shard


def resolved(model: ModelConfig, build: BuildConfig) -> ModelConfig:
    """`model` with what runs here: the build dtype resolved on this machine ("auto": bf16 with CUDA
    or a CPU with fast bf16, else float32) and the QuantMode of the build's precision fields."""
    dtype = resolve_dtype(build.dtype, torch.cuda.is_available())
    weight_format = lookup_build(build.weight_only)
    weight_bits = QuantMode(0) if weight_format is None else weight_format.quant_mode
    return dataclasses.replace(model, dtype=dtype,
                               quant_mode=int(QuantMode.from_build(weight_bits, build.kv_cache_dtype, build.act_quant)))


KV_CACHE_SCALE = "token_head"   # the scale layout of a quantized KV cache (runtime/kernels/kv_quant.py)


def with_kv_cache_scale(build: BuildConfig) -> BuildConfig:
    """`build` with the KV scale layout recorded: "token_head" for an int8 / fp8 cache, None else.

    NOTE: per (token, head) rather than per (block, head): a token's scale is written once with it,
    so a cache write never re-scales earlier entries (a block's scale would grow as tokens arrive,
    re-quantizing every row of the block), and blocks shared by reuse or beams never change. It
    costs 4 bytes per row of head_dim bytes (6% at head_dim 64); samples/microbench/kv_cache_dtype.py
    measures both layouts' error and bytes."""
    if build.kv_cache_dtype == "auto":
        if build.kv_cache_scale is not None:
            raise ConfigError(f"kv_cache_scale: {build.kv_cache_scale!r} applies only to an int8 / fp8 "
                              "kv_cache_dtype (it is 'auto')")
        return build
    if build.kv_cache_scale not in (None, KV_CACHE_SCALE):
        raise ConfigError(f"kv_cache_scale: {build.kv_cache_scale!r} is not implemented; this runtime "
                          f"stores {KV_CACHE_SCALE!r} scales")
    return dataclasses.replace(build, kv_cache_scale=KV_CACHE_SCALE)


def _settled(model: ModelConfig, build: BuildConfig, shard: TensorShard | tuple[int, int] | None,
             plan: StagePlan | None) -> tuple[ModelConfig, BuildConfig, TensorShard | None, StageLayers | None]:
    """Every loader's last step before reading weights: the KV scale layout recorded, what runs
    here resolved into the model config, the shard checked against both, the stage's layers."""
    build = with_kv_cache_scale(build)
    model = resolved(model, build)
    return model, build, _checked_shard(shard, model, build), None if plan is None else plan.layers(model.num_layers)


def _load_engine_dir(directory: str, overrides: dict, shard: TensorShard | tuple[int, int] | None,
                     plan: StagePlan | None) -> Engine:
    data = read_json(os.path.join(directory, ENGINE_CONFIG_FILE), ENGINE_CONFIG_FILE)
    if data.get("format") != ENGINE_FORMAT or data.get("version") != ENGINE_VERSION:
        raise ConfigError(f"{ENGINE_CONFIG_FILE}: unknown format/version "
                          f"({data.get('format')!r}, {data.get('version')!r}); expected "
                          f"({ENGINE_FORMAT!r}, {ENGINE_VERSION})")
    if not isinstance(data.get("model"), dict) or not isinstance(data.get("build"), dict):
        raise ConfigError(f"{ENGINE_CONFIG_FILE}: 'model' and 'build' must be objects")
    if overrides.get("weight_only") is not None and data["build"].get("weight_format") == "keep":
        overrides = {"weight_format": "dequantize", **overrides}   # kept blocks, quantized as asked
    try:
        model = model_config_from_dict(data["model"])
        build = BuildConfig.from_dict({**data["build"], **overrides})
    except TypeError as e:
        raise ConfigError(f"{ENGINE_CONFIG_FILE}: {e}") from None
    build.validated(model)
    if "weight_formats" in data:
        build = with_weight_format(build)
    model, build, shard, stage = _settled(model, build, shard, plan)
    stored = _stored_weight_only(data["build"], build, model)
    blocks = ({} if "weight_formats" not in data   # GGUF blocks kept: each weight's row segments
              else stored_block_layout(data["weight_formats"], expected_shapes(model), ENGINE_CONFIG_FILE))
    path, dtype = os.path.join(directory, ENGINE_WEIGHTS_FILE), TORCH_DTYPES[model.dtype]
    if blocks and build.weight_format != "keep":   # de-quantized (then quantized) as the load asks
        def read(s: TensorShard | None) -> tuple[Weights, int]:
            weights, num_bytes = load_engine_weights(path, model, dtype, s, blocks, stage)
            return dequantize_segments(weights, dtype), num_bytes
        weights, num_bytes_read = _read_quantized(read, model, build, shard)
    elif stored or blocks:   # built quantized or kept: the rank's slices of the stored tensors, as they are
        weights, num_bytes_read = load_engine_weights(path, model, dtype, shard, {**stored, **blocks}, stage)
    else:
        weights, num_bytes_read = _read_quantized(lambda s: load_engine_weights(path, model, dtype, s, stage=stage),
                                                  model, build, shard)
    return Engine(model, build, weights, directory, shard, num_bytes_read, stage)


def _stored_weight_only(recorded: dict, build: BuildConfig, model: ModelConfig) -> dict:
    """name -> (dtype, shape) of the quantized tensors an engine directory stores (empty when it
    stores none); a load asking for other weight-only settings than those built is a ConfigError."""
    built = BuildConfig.from_dict(recorded)
    if built.weight_only is None:
        return {}
    grouped = lookup_build(built.weight_only).is_grouped
    for name in ("weight_only", "group_size", "weight_only_skip"):
        if getattr(built, name) != getattr(build, name) and (name != "group_size" or grouped):
            raise ConfigError(f"{name}: the engine was built with {name}={getattr(built, name)!r}; it cannot "
                              f"load with {getattr(build, name)!r} (rebuild from the checkpoint)")
    return stored_layout(model, build)


def _load_hf_dir(directory: str, overrides: dict, shard: TensorShard | tuple[int, int] | None,
                 plan: StagePlan | None) -> Engine:
    hf = read_json(os.path.join(directory, "config.json"), "config.json")
    arch = lookup_hf(hf)
    model = arch.config_from_hf(hf)
    model, build, shard, stage = _settled(model, default_build_config(model, **overrides), shard, plan)
    weights, num_bytes_read = _read_quantized(
        lambda s: load_hf_weights(directory, model, TORCH_DTYPES[model.dtype], arch.read_weights, s, stage), model,
        build, shard)
    return Engine(model, build, weights, directory, shard, num_bytes_read, stage)


def _read_quantized(read: Callable[[TensorShard | None], tuple[Weights, int]], model: ModelConfig,
                    build: BuildConfig, shard: TensorShard | None) -> tuple[Weights, int]:
    """(the float weights `read(shard)` returns, quantized under `build` (as they are without
    weight_only); the bytes read).

    NOTE: with weight_only under a shard the weights are read whole, quantized, then sliced, so
    every rank holds the slices of the one quantized model (an int8 row's scale is its whole
    row's, not the rank's columns'): each rank reads the whole checkpoint, where an engine built
    with weight_only reads only the rank's slices of its stored tensors."""
    if build.weight_only is None or shard is None:
        weights, num_bytes_read = read(shard)
        return quantize_weights(weights, model, build), num_bytes_read
    whole, num_bytes_read = read(None)
    whole = quantize_weights(whole, model, build)
    shapes = {name: tuple(t.shape) for name, t in whole.items()}
    return {name: shard.slice(name, t, shapes) for name, t in whole.items()}, num_bytes_read


def _gguf_source(path: str) -> str | None:
    """The GGUF file `path` names: itself (a `.gguf` file), or the one `.gguf` file of a directory that
    is neither an engine nor an HF checkpoint; None for anything else."""
    if os.path.isdir(path):
        if any(os.path.exists(os.path.join(path, name)) for name in (ENGINE_CONFIG_FILE, "config.json")):
            return None
    elif not path.endswith(".gguf"):
        return None
    from .loading.gguf_checkpoint import find_gguf
    return find_gguf(path)


def _load_gguf(checkpoint: GgufCheckpoint, source: str, overrides: dict,
               shard: TensorShard | tuple[int, int] | None, plan: StagePlan | None) -> Engine:
    """The weights in the build dtype, the matmul weights' blocks kept where the build's
    weight_format (resolved here) says; `source`: the path the caller gave."""
    model = checkpoint.model_config
    asked = default_build_config(model, **overrides)
    model, build, shard, stage = _settled(model, with_weight_format(asked), shard, plan)
    dtype, keep = TORCH_DTYPES[model.dtype], build.weight_format == "keep"

    def read(s: TensorShard | None) -> tuple[Weights, int]:
        # auto: a weight in a quantized type without a kept format is de-quantized; keep: refused
        raw = checkpoint.read_weights(dtype, keep_blocks=keep, strict=asked.weight_format == "keep")
        kept = {name: (t.dtype, tuple(t.shape)) for name, t in raw.items() if is_segment(name)}
        return check_weights(raw, model, dtype, checkpoint.path, s, stage, kept), checkpoint.num_bytes_read

    weights, num_bytes_read = _read_quantized(read, model, build, shard)
    return Engine(model, build, weights, source, shard, num_bytes_read, stage)


def with_weight_format(build: BuildConfig) -> BuildConfig:
    """`build` with weight_format "auto" resolved: keep a GGUF file's blocks where the native block
    kernels run on this machine and no weight_only mode is asked for, else de-quantize.

    NOTE: without the native kernels a kept weight is de-quantized tile by tile at every step
    (torch), many times slower at one stream than a de-quantized engine's GEMV (README, "GGUF
    files"), so "auto" keeps blocks only where they run natively; "keep" forces them (tests,
    memory-bound deployments)."""
    if build.weight_format != "auto":
        return build
    from .kernels.torch_kernels.block_linear import block_ops
    keep = build.weight_only is None and block_ops() is not None
    return dataclasses.replace(build, weight_format="keep" if keep else "dequantize")


def build_engine(checkpoint_dir: str | os.PathLike, output_dir: str | os.PathLike, **build_fields) -> Engine:
    """Convert an HF checkpoint or a GGUF file into an engine directory with the given build-time
    limits; from a GGUF file, also write its tokenizer there (runtime.loading.gguf_tokenizer).

    NOTE: the conversion runs on a short-lived thread. On CPU a thread that has run torch's
    OpenMP regions keeps its thread pool until it exits; with the caller's pool alive beside the
    serving worker's, libgomp counts more threads than cores and stops spinning between regions:
    one-stream int8 steps of the default model measured 18.7 ms instead of 7.5 (2 cores) when the
    caller had built the engine and then served it from the same process."""
    return on_own_thread(_build_engine, checkpoint_dir, output_dir, **build_fields)


def on_own_thread(fn: Callable[..., T], *args, **kwargs) -> T:
    """fn(*args, **kwargs) on a new thread, joined: its result, or what it raised."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append((True, fn(*args, **kwargs)))
        except BaseException as e:  # noqa: BLE001 - raised again on the caller's thread
            outcome.append((False, e))

    thread = threading.Thread(target=run, name="build_engine")
    thread.start()
    thread.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def _build_engine(checkpoint_dir: str | os.PathLike, output_dir: str | os.PathLike, **build_fields) -> Engine:
    source = os.fspath(checkpoint_dir)
    gguf_path = _gguf_source(source)
    if gguf_path is None:
        engine = Engine.from_dir(source, **build_fields)
        engine.save(output_dir)
        return engine
    from .loading.gguf_checkpoint import GgufCheckpoint
    from .loading.gguf_tokenizer import tokenizer_files, write_files
    with GgufCheckpoint(gguf_path) as checkpoint:
        files = tokenizer_files(checkpoint.file)   # before writing anything: a tokenizer error leaves no engine
        engine = _load_gguf(checkpoint, source, build_fields, None, None)
    engine.save(output_dir)
    write_files(files, os.fspath(output_dir))
    return engine
