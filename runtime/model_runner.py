"""The tensor-dict runtime: owns the model on its device and the paged KV pool (its block storage:
`read_blocks` / `write_blocks` move blocks' bytes in and out for the KV transfer).

`ModelRunner.forward(inputs) -> outputs`, like an engine's named I/O. Inputs (CPU or device):

  input_ids             int32 [T]     new tokens of every sequence, packed in sequence order
  input_lengths         int32 [S]     new tokens per sequence (1 for a generation step)
  past_lengths          int32 [S]     tokens of the sequence already in the KV cache
  block_tables          int32 [S, B]  KV block ids of each sequence, in token order; entries
                                      past ceil((past + new) / tokens_per_block) are ignored
  position_ids          int32 [T]     optional; default past_length + offset within the step
  return_context_logits bool  [S]     optional; sequences whose every new token's logits are returned
  num_logits            int32 [S]     optional (default 1 each): logits of each sequence's last n new
                                      tokens, 1 <= n <= its input length (a token + D drafts: D + 1)
  lora_task_ids         int64 [S]     optional: each sequence's LoRA adapter (-1: none), resident in
                                      `lora_store` (runtime.adapters.lora_step)
  prompt_embedding_table float [P, H] optional, with the two below (runtime.adapters.prompt_tuning): the
  prompt_table_offsets  int32 [S]     step's prompt tables stacked, each sequence's first row (-1:
  prompt_vocab_sizes    int32 [S]     none) and row count; an id vocab_size + j takes row j

Outputs:
  logits                float32 [L, V]  logits of each sequence's last num_logits new tokens, packed in
                                        sequence order (L = S without num_logits)
  context_logits        float32 [C, V]  only when asked: the flagged sequences' tokens, packed

A sequence's new K/V are written to the cache before attention; a step may mix any number of
context sequences (any lengths, with or without cached past) and generation sequences.

Attention window and sink tokens (`max_attention_window`, `sink_token_length`): a query at
position q sees the keys at k with k <= q and (k > q - w or k < s), where w is the smaller of
`max_attention_window` and the model's own sliding window (either may be None) and s applies only
when some window exists. Positions stay the tokens' original positions (no shift of positions
into the window, as TensorRT-LLM without its cyclic-position option; StreamingLLM re-indexes
instead). A block-table entry whose block holds no key any query of its sequence can see in
this step may be negative (the block was released); every other used entry must be a block id.
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import torch

from .engine import Engine
from .greedy_steps import GreedySteps, decode_greedy
from .loading.weights import weights_fingerprint
from .kernels import get_kernels
from .kernels.cpu.weight_memory import seal as seal_weight_chunks
from .kernels.kv_quant import check_kv_storage, is_quantized_kv
from .adapters.lora_step import LoraWeightStore
from .models.transformer import StepLayout, Transformer
from .parallel.pipeline import LOGITS_TAG, PendingReceive
from .parallel.tensor_parallel import TensorParallel
from .parallel.tensor_shard import TensorShard
from .quantization.block_weights import has_weight
from .step_layout import StepPlanner



def release_freed_heap() -> None:
    """Return the C heap's free pages to the system (glibc's malloc_trim; nothing on another libc).

    NOTE: preparing the weights (act_quant's repacking) frees temporaries of a weight's size that
    glibc keeps in its heap between live blocks: 0.5x the int8 weights stayed resident, measured
    (tests/runtime/test_resident_weights.py), until trimmed once the model is built."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass


def effective_window(model_window: int | None, max_attention_window: int | None) -> int | None:
    """The window attention uses: the smaller of the model's own and the configured one."""
    windows = [w for w in (model_window, max_attention_window) if w is not None]
    return min(windows) if windows else None


def available_memory_bytes(device: torch.device) -> int:
    """Free device memory (CUDA) or available host memory (CPU; unbounded where unknown)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


@dataclass(frozen=True)
class KvBlocks:
    """Some blocks of a KV pool as raw bytes on the host, per pool, in parts along the block axis
    (their concatenation is the blocks in order): values uint8 [L, 2, n_i, tpb, H, D * element
    size] and a quantized pool's float32 scales uint8 [L, 2, n_i, tpb, H * 4] (else None)."""
    values: tuple[torch.Tensor, ...]
    scales: tuple[torch.Tensor, ...] | None = None


@dataclass(frozen=True)
class LaunchedForward:
    """A forward `ModelRunner.launch` started: its logits (float32 [rows, vocab]) and context
    logits, each a tensor, None (not this rank's), or still on the way from the last stage."""
    logits: "torch.Tensor | PendingReceive | None"
    context_logits: "torch.Tensor | PendingReceive | None" = None


class ModelRunner:
    def __init__(self, engine: Engine, num_blocks: int, kernels=None, device: str | torch.device | None = None,
                 max_attention_window: int | None = None, sink_token_length: int | None = None,
                 linear_impl: str | None = None, tensor_parallel: TensorParallel | None = None,
                 gather_logits_to_all: bool = True, fused_decode: bool = True):
        """linear_impl: the CPU matmul kernel (one of runtime.kernels.torch_kernels.linear.CPU_IMPLS; default: the
        fastest this torch build has); ignored on GPUs.
        tensor_parallel: this rank's world (runtime.parallel.tensor_parallel); every rank then runs the same
        forwards, in the same order. The engine holds the rank's slices (Engine.from_dir with its
        shard) or whole weights (sliced here). gather_logits_to_all: every rank gets the logits;
        else rank 0 only (the others' outputs hold None). fused_decode: steps of a few sequences
        with one new token each run as one native call where the kernel backend has one for the
        model (kernels.prepare_decode_step; also off with BATCH_MANAGER_FUSED_DECODE=0); False:
        every step op by op (the reference)."""
        cfg = engine.model_config
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks: must be a positive integer, got {num_blocks!r}")
        for name, value, low in (("max_attention_window", max_attention_window, 1),
                                 ("sink_token_length", sink_token_length, 0)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
                raise ValueError(f"{name}: must be an integer >= {low}, got {value!r}")
        self.attention_window = effective_window(cfg.sliding_window, max_attention_window)
        self.sink_token_length = (sink_token_length or 0) if self.attention_window is not None else 0
        # NOTE: the runner keeps no reference to the Engine: once the model has prepared its
        # matmul weights (a reordered or repacked copy on a CPU), the engine's own tensors (a mapped
        # weights file's pages) are freed with it unless the caller keeps it.
        self.model_config = cfg
        self.build_config = engine.build_config
        self.dtype, self.kv_storage_dtype = engine.dtype, engine.kv_storage_dtype
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.kernels = kernels if kernels is not None and not isinstance(kernels, str) else get_kernels(kernels)
        check_kv_storage(self.kernels, engine.build_config.kv_cache_dtype, engine.kv_storage_dtype)
        self.tokens_per_block = engine.build_config.tokens_per_block
        self.num_blocks = num_blocks
        # Pipeline parallelism: this rank's stage (its layers, and the transfers to its neighbours).
        self.stage = tensor_parallel.pipeline_stage(cfg.num_layers) if tensor_parallel is not None else None
        num_layers = cfg.num_layers if self.stage is None else self.stage.layers.num_layers
        pool_bytes = num_blocks * self.kv_bytes_per_block(engine, tensor_parallel.size if tensor_parallel else 1,
                                                          num_layers)
        available = available_memory_bytes(self.device)
        if pool_bytes > available:
            raise ValueError(f"num_blocks: a KV pool of {num_blocks} blocks of {self.tokens_per_block} tokens needs "
                             f"{pool_bytes / 2**30:.1f} GiB; only {available / 2**30:.1f} GiB are available on "
                             f"{self.device}")
        self.tensor_parallel = tensor_parallel
        self.gather_logits_to_all = gather_logits_to_all
        self.shard = self._shard(engine, tensor_parallel)
        weights = self._stage_weights(engine)
        # of the weights as loaded (before any preparation), so that peers compare what they read
        self.weights_fingerprint = weights_fingerprint(engine.weights)
        if self.shard is not None and engine.shard is None:
            shapes = {name: tuple(t.shape) for name, t in weights.items()}
            weights = {name: self.shard.slice(name, t, shapes) for name, t in weights.items()}
        model_tp = tensor_parallel if tensor_parallel is not None and tensor_parallel.size > 1 else None
        self.model = Transformer(cfg, weights, self.device, self.kernels, self.attention_window,
                                 self.sink_token_length, linear_impl, model_tp, self.shard,
                                 gather_logits_to_all, None if self.stage is None else self.stage.layers,
                                 act_quant=engine.build_config.act_quant)
        # [num_layers, K/V, num_blocks, tokens_per_block, num_kv_heads, head_dim]: this rank's KV heads
        # of its stage's layers
        kv_dtype = engine.kv_storage_dtype
        self.kv_pool = torch.zeros(num_layers, 2, num_blocks, self.tokens_per_block,
                                   self.model.local.num_kv_heads, cfg.head_dim, dtype=kv_dtype, device=self.device)
        # float32 [num_layers, K/V, num_blocks, tokens_per_block, num_kv_heads]: the scale of each
        # (token, head) row of a quantized pool (kernels/kv_quant.py); None for an unquantized one
        self.kv_scales = None
        if is_quantized_kv(kv_dtype):
            self.kv_scales = torch.zeros(self.kv_pool.shape[:-1], dtype=torch.float32, device=self.device)
        self.lora_store = LoraWeightStore(self.device, engine.dtype, self.shard)   # task id -> resident adapter
        self.planner = StepPlanner(cfg.vocab_size, cfg.hidden_size, self.tokens_per_block, num_blocks,
                                   self.attention_window, self.sink_token_length, self.device, engine.dtype,
                                   self.lora_store)
        # The generation step as one call where the backend has one for this model (None: op by op).
        self.decode_step = (self.kernels.prepare_decode_step(self.model, self.kv_pool, self.kv_scales,
                                                             self.tokens_per_block)
                            if fused_decode and self.stage is None else None)
        seal_weight_chunks()
        release_freed_heap()

    def _stage_weights(self, engine: Engine) -> dict[str, torch.Tensor]:
        """The engine's weights of this rank's stage (an engine loaded whole gives up the others)."""
        if self.stage is None:
            if engine.stage is not None:
                raise ValueError("pipeline: the engine holds one stage's layers; give the runner its world")
            return engine.weights
        layers = self.stage.layers
        if engine.stage is not None:
            if engine.stage != layers:
                raise ValueError(f"engine: holds the layers of stage {engine.stage}, but this rank runs {layers}")
            return engine.weights
        tied = not has_weight(engine.weights, "lm_head")
        return {name: t for name, t in engine.weights.items() if layers.holds(name, tied)}

    @staticmethod
    def _shard(engine: Engine, tensor_parallel: TensorParallel | None) -> TensorShard | None:
        if tensor_parallel is None or tensor_parallel.size == 1:
            if engine.shard is not None:
                raise ValueError("tensor_parallel: the engine holds one rank's slices; give the runner its world")
            return None
        shard = tensor_parallel.shard(engine.model_config)
        if engine.shard is not None and engine.shard != shard:
            raise ValueError(f"engine: holds the slices of rank {engine.shard.rank} of {engine.shard.size}, "
                             f"but this is rank {shard.rank} of {shard.size}")
        return shard

    @staticmethod
    def kv_bytes_per_block(engine: Engine, tensor_parallelism: int = 1, num_layers: int | None = None) -> int:
        """Bytes of one block of one rank's pool (its KV heads of `num_layers` layers, default all)
        under `tensor_parallelism` ranks: the values and, for a quantized cache, their float32
        scales (one per token, head, K and V)."""
        return engine.kv_bytes_per_token(tensor_parallelism, num_layers) * engine.build_config.tokens_per_block

    def forward(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.finish(self.launch(inputs))

    @torch.inference_mode()
    def launch(self, inputs: dict[str, torch.Tensor]) -> "LaunchedForward":
        """Start a forward; `finish` gives its outputs. Under pipeline parallelism this rank's
        part runs now (its layers, the send to the next stage) while global rank 0's logits are
        received in `finish`, so rank 0 can launch the next micro-batch while the later stages
        compute this one. Without a pipeline the whole forward runs here."""
        if self.decode_step is not None:
            fused = self.planner.fused_generation(inputs, self.decode_step.max_rows)
            if fused is not None:
                return LaunchedForward(self.decode_step(*fused))
        step = self.planner.layout(inputs)
        if self.stage is None:
            return LaunchedForward(*self.model.forward(step, self.kv_pool, self.kv_scales))
        return self._launch_stage(step)

    def decode_greedy(self, inputs: dict[str, torch.Tensor], num_steps: int,
                      end_ids: list[int | None] | None = None) -> GreedySteps:
        """Up to `num_steps` greedy generation steps in one call (runtime.greedy_steps)."""
        return decode_greedy(self, inputs, num_steps, end_ids)

    @staticmethod
    def finish(launched: "LaunchedForward") -> dict[str, torch.Tensor]:
        """The launched forward's outputs: {"logits": float32 [rows, vocab], and "context_logits"
        when asked}; None logits on the ranks that do not receive them (pipeline ranks != 0)."""
        logits, context_logits = launched.logits, launched.context_logits
        if isinstance(logits, PendingReceive):
            logits = logits.wait()
        if isinstance(context_logits, PendingReceive):
            context_logits = context_logits.wait()
        outputs = {"logits": logits}
        if context_logits is not None:
            outputs["context_logits"] = context_logits
        return outputs

    def _launch_stage(self, step: StepLayout) -> "LaunchedForward":
        """This stage's layers between its neighbours' transfers; the logits (and context logits)
        then reach every rank (gather_logits_to_all) or global rank 0 (the others get None)."""
        stage, layers = self.stage, self.stage.layers
        num_rows = step.logits_token_index.numel()
        num_context = None if step.context_logits_index is None else step.context_logits_index.numel()
        vocab = self.model_config.vocab_size
        hidden = None
        if not layers.is_first:
            hidden = stage.receive((step.input_ids.numel(), self.model_config.hidden_size), self.model.dtype,
                                   stage.previous, "hidden states")
        elif stage.global_rank == 0 and not self.gather_logits_to_all and not layers.is_last:
            # posted before this stage's work: the last stage may answer before it is done
            launched = LaunchedForward(
                stage.post_logits_receive((num_rows, vocab), "logits"),
                None if num_context is None else stage.post_logits_receive((num_context, vocab), "context logits"))
        out, context_logits = self.model.forward(step, self.kv_pool, self.kv_scales, hidden)
        logits = None
        if layers.is_last:
            logits = out
        else:
            stage.send(out, stage.next, "hidden states")
        if self.gather_logits_to_all:
            logits = stage.broadcast_from_last(logits, (num_rows, vocab))
            if num_context is not None:
                context_logits = stage.broadcast_from_last(context_logits, (num_context, vocab))
            return LaunchedForward(logits, context_logits)
        if stage.sends_logits:
            stage.send(logits, 0, "logits", LOGITS_TAG)
            if num_context is not None:
                stage.send(context_logits, 0, "context logits", LOGITS_TAG)
            return LaunchedForward(None, None)
        if stage.global_rank != 0:
            return LaunchedForward(None, None)
        return launched

    def _byte_pools(self) -> list[torch.Tensor | None]:
        """uint8 views of the pools (the last dimension widened by the element size): values, scales or None."""
        return [None if pool is None else pool.view(torch.uint8) for pool in (self.kv_pool, self.kv_scales)]

    @property
    def kv_block_byte_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
        """Per pool, the byte shape of its blocks in `KvBlocks` less the block axis: values
        (L, 2, tpb, H, D * element size), a quantized pool's scales (L, 2, tpb, H * 4), else None."""
        return tuple(None if p is None else (*p.shape[:2], *p.shape[3:]) for p in self._byte_pools())

    def read_blocks(self, block_ids: list[int]) -> KvBlocks:
        """The blocks' bytes, in `block_ids` order. A CPU pool's are views of it (a part per run of
        consecutive ids, no copy: reads see later writes; views only, no torch op that could start
        an OpenMP pool on the caller's thread); a GPU pool's one part, gathered on the device and
        copied to the host."""
        pools = self._byte_pools()
        if self.device.type != "cpu":
            ids = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
            return KvBlocks(*[None if pool is None else (pool.index_select(2, ids).cpu(),) for pool in pools])
        starts = [j for j, b in enumerate(block_ids) if j == 0 or b != block_ids[j - 1] + 1]   # a part per run
        runs = [(block_ids[a], block_ids[b - 1] + 1) for a, b in zip(starts, starts[1:] + [len(block_ids)])]
        return KvBlocks(*[None if pool is None else tuple(pool[:, :, a:b] for a, b in runs) for pool in pools])

    @torch.inference_mode()
    def write_blocks(self, block_ids: list[int], data: KvBlocks, slots: list[int] | None = None) -> None:
        """Block block_ids[i] of each pool takes `data`'s block slots[i] (default i). ValueError, and
        nothing written, when `data` has not this pool's byte shapes or scales."""
        dst = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        src = torch.tensor(range(len(block_ids)) if slots is None else slots, dtype=torch.int64)
        given = [None if parts is None else {(*p.shape[:2], *p.shape[3:]) for p in parts}
                 for parts in (data.values, data.scales)]
        if given != [None if shape is None else {shape} for shape in self.kv_block_byte_shapes]:
            raise ValueError(f"KV blocks of byte shapes {given} (less the block axis) do not fit this pool's "
                             f"{self.kv_block_byte_shapes}")
        for pool, parts in zip(self._byte_pools(), (data.values, data.scales)):
            if pool is not None:
                blocks = parts[0] if len(parts) == 1 else torch.cat(parts, 2)
                pool.index_copy_(2, dst, blocks.index_select(2, src).to(self.device))

    def memory_bytes(self) -> tuple[int, int]:
        """Bytes of the weights and the KV pool (with its scales) on the CPU and on the GPU."""
        tensors = [*self.model.weight_tensors(), *(p for p in (self.kv_pool, self.kv_scales) if p is not None)]
        on_cpu = [(t.device.type == "cpu", t.numel() * t.element_size()) for t in tensors]
        return sum(n for cpu, n in on_cpu if cpu), sum(n for cpu, n in on_cpu if not cpu)

    @torch.inference_mode()
    def copy_blocks(self, src_block_ids: list[int], dst_block_ids: list[int]) -> None:
        src = torch.tensor(src_block_ids, dtype=torch.int64, device=self.device)
        dst = torch.tensor(dst_block_ids, dtype=torch.int64, device=self.device)
        self.kernels.copy_blocks(self.kv_pool, src, dst)
        if self.kv_scales is not None:
            self.kernels.copy_blocks(self.kv_scales, src, dst)
