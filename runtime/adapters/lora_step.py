"""The runtime's LoRA store (task id -> resident adapter, loaded and evicted by the manager's step
fields) and the per-step computation (`LoraStepPlan`): the base matmul of a linear ran once for all
rows; this adds each adapter's B A x to the rows of its tokens.

Two ways, chosen per step (and per MLP row chunk):
- batched, when at least two adapters share the rows evenly enough (padding k x L rows, k adapters
  of at most L rows, to at most twice the rows they have): one gather, two bmm over the adapters'
  factors stacked (ranks zero-padded to the largest, which adds exact zeros), one scatter-add. Five
  ops per linear whatever the number of adapters: generation steps of many requests on several
  adapters are dominated by per-op cost on CPU.
- a loop over the step's distinct adapters (never over requests or tokens): two matmuls each,
  on a row slice where an adapter's rows are contiguous. Long, uneven context steps.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from .lora import LoraAdapter
from ..parallel.tensor_shard import TensorShard, take

# Stacked factors are kept for this many sets of adapters (a steady stream of steps sees few).
MAX_STACKED_SETS = 8


class LoraWeightStore:
    """task id -> LoraAdapter resident on the runner's device, in its dtype; and the stacked factors
    of the sets of adapters recent steps used together (dropped when one of them leaves)."""

    def __init__(self, device: torch.device, dtype: torch.dtype, shard: TensorShard | None = None):
        """shard: under tensor parallelism, the rank's slices: an adapter is sliced like its base
        linears (B's rows of the column-parallel qkv / mlp_in, A's columns of the row-parallel
        out / mlp_out, whose partial products the all-reduce sums)."""
        self.device, self.dtype, self.shard = device, dtype, shard
        self._adapters: dict[int, LoraAdapter] = {}
        # task ids (sorted) -> linear prefix -> (A [k, Hi, R], B [k, R, Ho]) or None; LRU order
        self._stacked: OrderedDict[tuple[int, ...], dict[str, tuple[torch.Tensor, torch.Tensor] | None]] = \
            OrderedDict()

    def __contains__(self, task_id: int) -> bool:
        return task_id in self._adapters

    def __len__(self) -> int:
        return len(self._adapters)

    def __getitem__(self, task_id: int) -> LoraAdapter:
        return self._adapters[task_id]

    def load(self, task_id: int, adapter: LoraAdapter) -> None:
        self._forget_stacks(task_id)
        if self.shard is not None:
            adapter = _sliced(adapter, self.shard)
        self._adapters[task_id] = adapter.to(self.device, self.dtype)

    def evict(self, task_id: int) -> None:
        self._forget_stacks(task_id)
        self._adapters.pop(task_id, None)

    def _forget_stacks(self, task_id: int) -> None:
        for key in [k for k in self._stacked if task_id in k]:
            del self._stacked[key]

    def stacked(self, task_ids: tuple[int, ...], prefix: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The factors of the linear `prefix` of adapters `task_ids`, stacked: A^T [k, Hi, R] and
        B^T [k, R, Ho], R the largest rank, zeros for an adapter without that linear; None when none
        of them has it. Built once per set and linear."""
        per_linear = self._stacked.get(task_ids)
        if per_linear is None:
            per_linear = self._stacked[task_ids] = {}
            while len(self._stacked) > MAX_STACKED_SETS:
                self._stacked.popitem(last=False)
        self._stacked.move_to_end(task_ids)
        if prefix not in per_linear:
            per_linear[prefix] = _stack([self._adapters[t].factors.get(prefix) for t in task_ids])
        return per_linear[prefix]

    def plan(self, task_ids: list[int], starts: list[int], lengths: list[int]) -> "LoraStepPlan | None":
        """task_ids [S] (-1: no adapter), token starts and counts [S] -> the step's plan (None when
        no sequence has an adapter). ValueError for a task id that is not resident."""
        token_ids_of: dict[int, list[int]] = {}
        for seq, task_id in enumerate(task_ids):
            if task_id < 0:
                continue
            if task_id not in self._adapters:
                raise ValueError(f"lora_task_ids: task {task_id} (sequence {seq}) is not loaded in the runtime")
            token_ids_of.setdefault(task_id, []).extend(range(starts[seq], starts[seq] + lengths[seq]))
        if not token_ids_of:
            return None
        return LoraStepPlan([(t, token_ids_of[t]) for t in sorted(token_ids_of)], self)


def _sliced(adapter: LoraAdapter, shard: TensorShard) -> LoraAdapter:
    """B A x restricted to the rank's slice of the base weight: its output rows (B's rows) of a
    column-parallel linear, its input columns (A's columns) of a row-parallel one."""
    factors = {}
    for prefix, (a, b) in adapter.factors.items():
        selection = shard.selection(prefix + ".weight")
        if selection is not None:
            dim, spans = selection
            if dim == 0:
                b = take(b, 0, spans)
            else:
                a = take(a, 1, spans)
        factors[prefix] = (a, b)
    return LoraAdapter(factors, adapter.num_rows, adapter.num_bytes, adapter.ranks)


def _stack(factors: list[tuple[torch.Tensor, torch.Tensor] | None]) -> tuple[torch.Tensor, torch.Tensor] | None:
    present = [f for f in factors if f is not None]
    if not present:
        return None
    a0, b0 = present[0]
    rank = max(a.shape[0] for a, _ in present)
    a_t = a0.new_zeros(len(factors), a0.shape[1], rank)      # [k, Hi, R]
    b_t = b0.new_zeros(len(factors), rank, b0.shape[0])      # [k, R, Ho]
    for i, f in enumerate(factors):
        if f is not None:
            a, b = f
            a_t[i, :, :a.shape[0]] = a.t()
            b_t[i, :b.shape[1], :] = b.t()
    return a_t, b_t


@dataclass(frozen=True)
class _Batched:
    task_ids: tuple[int, ...]        # the k adapters, sorted
    index: torch.Tensor              # int64 [k * L]: each adapter's rows, padded with its first row
    mask: torch.Tensor | None        # [k, L, 1]: 0 on padding rows (None: no padding)
    num_rows: int                    # L


class LoraStepPlan:
    """One step's adapters and their token rows (see the module docstring for the two ways)."""

    def __init__(self, groups: list[tuple[int, list[int]]], store: LoraWeightStore):
        self._groups = groups            # (task id, sorted token indices of its sequences), by task id
        self._store = store
        self._ranges: dict[tuple[int, int], _Batched | list[tuple[LoraAdapter, slice | torch.Tensor]]] = {}

    def _range(self, row_start: int, num_rows: int) -> _Batched | list[tuple[LoraAdapter, slice | torch.Tensor]]:
        """How to compute rows [row_start, row_start + num_rows) (relative indices; cached per range)."""
        key = (row_start, num_rows)
        cached = self._ranges.get(key)
        if cached is None:
            stop = row_start + num_rows
            local = [(t, [r - row_start for r in rows if row_start <= r < stop]) for t, rows in self._groups]
            local = [(t, rows) for t, rows in local if rows]
            cached = self._ranges[key] = self._batched(local) or self._looped(local)
        return cached

    def is_batched(self, row_start: int, num_rows: int) -> bool:
        """Rows [row_start, row_start + num_rows) run as one batched product, not one per adapter."""
        return isinstance(self._range(row_start, num_rows), _Batched)

    def _batched(self, local: list[tuple[int, list[int]]]) -> _Batched | None:
        longest, total = max((len(rows) for _, rows in local), default=0), sum(len(rows) for _, rows in local)
        if len(local) < 2 or len(local) * longest > 2 * total:
            return None
        device = self._store.device
        index = torch.tensor([r for _, rows in local for r in rows + [rows[0]] * (longest - len(rows))],
                             dtype=torch.int64, device=device)
        mask = None
        if len(local) * longest != total:
            mask = torch.tensor([[1.0] * len(rows) + [0.0] * (longest - len(rows)) for _, rows in local],
                                dtype=self._store.dtype, device=device)[:, :, None]
        return _Batched(tuple(t for t, _ in local), index, mask, longest)

    def _looped(self, local: list[tuple[int, list[int]]]) -> list[tuple[LoraAdapter, slice | torch.Tensor]]:
        out = []
        for t, rows in local:
            if rows[-1] - rows[0] + 1 == len(rows):
                out.append((self._store[t], slice(rows[0], rows[-1] + 1)))
            else:
                out.append((self._store[t], torch.tensor(rows, dtype=torch.int64, device=self._store.device)))
        return out

    def apply(self, prefix: str, x: torch.Tensor, y: torch.Tensor, row_start: int = 0) -> None:
        """y [n, out] += B A x [n, in] for the rows of each adapter that has factors for the linear
        `prefix` ("layers.{l}.{linear}"); x and y hold tokens [row_start, row_start + n) of the step.
        y is changed in place (also a strided view)."""
        plan = self._range(row_start, x.shape[0])
        if isinstance(plan, _Batched):
            stacked = self._store.stacked(plan.task_ids, prefix)
            if stacked is None:
                return
            a_t, b_t = stacked
            k = len(plan.task_ids)
            h = torch.bmm(x.index_select(0, plan.index).view(k, plan.num_rows, -1), a_t)   # [k, L, R]
            if plan.mask is not None:
                h.mul_(plan.mask)
            y.index_add_(0, plan.index, torch.bmm(h, b_t).view(k * plan.num_rows, -1))
            return
        for adapter, rows in plan:
            factors = adapter.factors.get(prefix)
            if factors is None:
                continue
            a, b = factors
            if isinstance(rows, slice):
                y[rows].add_(torch.mm(torch.mm(x[rows], a.t()), b.t()))
            else:
                y.index_add_(0, rows, torch.mm(torch.mm(x.index_select(0, rows), a.t()), b.t()))
