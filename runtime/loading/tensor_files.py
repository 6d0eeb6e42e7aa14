"""Tensors of safetensors files read by byte offsets: the header parsed and checked here, whole
tensors mapped in place, slices read with preadv. `TensorSource.get` gives a `LazyTensor` (rows of
stored tensors, maybe transposed: shape and places in the files, no data) that the architectures'
readers compose (runtime.loading.weights, runtime.models); `TensorSource.read` reads one, or only a
tensor-parallel rank's selection of it, and counts the bytes read.
"""
from __future__ import annotations

import glob
import itertools
import json
import math
import mmap
import os
import stat
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Sequence

import torch

from ..config import read_json

if TYPE_CHECKING:
    from ..parallel.tensor_shard import Ranges

# safetensors dtype -> torch dtype. Non-float ones are mapped only so that the check names them.
SAFETENSORS_DTYPES = {name: getattr(torch, attr) for name, attr in (
    ("F64", "float64"), ("F32", "float32"), ("F16", "float16"), ("BF16", "bfloat16"),
    ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"), ("F8_E8M0", "float8_e8m0fnu"),
    ("I64", "int64"), ("I32", "int32"), ("I16", "int16"), ("I8", "int8"), ("U8", "uint8"),
    ("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"), ("BOOL", "bool")) if hasattr(torch, attr)}
MAX_HEADER_BYTES = 100_000_000   # safetensors' own limit


class WeightError(ValueError):
    """A missing, misshaped or unreadable weight; the message names the tensor."""


# -- lazy tensors: shapes and places in the files, no data -------------------------------------------

@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors file: its row-major bytes are [offset, offset + nbytes) of `path`.
    dtype None: a dtype torch cannot hold (an error when read)."""
    name: str
    path: str
    dtype: torch.dtype | None
    dtype_name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def row_bytes(self) -> int:
        """Bytes of one index of dim 0 (a 0-d or 1-d tensor's rows are its elements)."""
        return self.dtype.itemsize * math.prod(self.shape[1:])

    @property
    def num_rows(self) -> int:
        return self.shape[0] if self.shape else 1


@dataclass(frozen=True)
class RowRun:
    """Rows [start, stop) of a stored tensor (along its dim 0)."""
    stored: StoredTensor
    start: int
    stop: int


@dataclass(frozen=True)
class LazyTensor:
    """A tensor not read yet: its rows are the runs' rows in order (every run's trailing dims are
    `row_shape`), transposed when `transposed` (2-D only). The reader helpers compose these (cat rows,
    take rows, transpose); TensorSource.read reads one, whole or a slice, by byte offsets."""
    runs: tuple[RowRun, ...]
    row_shape: tuple[int, ...]
    dtype: torch.dtype
    transposed: bool = False

    @property
    def num_rows(self) -> int:
        return sum(run.stop - run.start for run in self.runs)

    @property
    def shape(self) -> torch.Size:
        shape = (self.num_rows, *self.row_shape)
        return torch.Size(shape[::-1] if self.transposed else shape)

    def dim(self) -> int:
        return len(self.shape)

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def t(self) -> "LazyTensor":
        assert self.dim() == 2, f"t() of a {self.dim()}-d tensor"
        return replace(self, transposed=not self.transposed)

    def take_rows(self, spans: Sequence[tuple[int, int]]) -> "LazyTensor":
        """The rows [start, stop) of each span, in the order given (any order: a row permutation)."""
        assert not self.transposed, "take_rows of a transposed tensor"
        bounds = list(itertools.accumulate((run.stop - run.start for run in self.runs), initial=0))
        runs: list[RowRun] = []
        for start, stop in spans:
            assert 0 <= start <= stop <= bounds[-1], f"rows [{start}, {stop}) of {bounds[-1]}"
            for run, first in zip(self.runs, bounds):
                lo, hi = max(start, first), min(stop, first + run.stop - run.start)
                if lo < hi:
                    _append_run(runs, RowRun(run.stored, run.start + lo - first, run.start + hi - first))
        return replace(self, runs=tuple(runs))

    @staticmethod
    def cat_rows(parts: Sequence["LazyTensor"]) -> "LazyTensor":
        """Concatenation along dim 0 (dtypes promote as torch.cat's do)."""
        assert parts and all(not p.transposed and p.row_shape == parts[0].row_shape for p in parts)
        runs: list[RowRun] = []
        for run in itertools.chain.from_iterable(p.runs for p in parts):
            _append_run(runs, run)
        dtype = parts[0].dtype
        for part in parts[1:]:
            dtype = torch.promote_types(dtype, part.dtype)
        return LazyTensor(tuple(runs), parts[0].row_shape, dtype)


def _append_run(runs: list[RowRun], run: RowRun) -> None:
    """Append, merging with the last run when it continues it (fewer, longer reads)."""
    if runs and runs[-1].stored == run.stored and runs[-1].stop == run.start:
        runs[-1] = RowRun(run.stored, runs[-1].start, run.stop)
    else:
        runs.append(run)


# -- safetensors files, read by byte offsets ----------------------------------------------------------

class _File:
    """An open safetensors file: its header (name -> StoredTensor) and a descriptor for pread."""

    def __init__(self, path: str):
        self.path = path
        try:
            # O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused just below).
            self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as e:
            raise WeightError(f"{path}: not a readable safetensors file: {e}") from None
        try:
            self.tensors = self._read_header()
        except OSError as e:
            os.close(self.fd)
            raise self._error(str(e)) from None
        except BaseException:
            os.close(self.fd)
            raise

    def _error(self, reason: str) -> WeightError:
        return WeightError(f"{self.path}: not a readable safetensors file: {reason}")

    def _read_header(self) -> dict[str, StoredTensor]:
        """Header: 8 bytes (little-endian length n), n bytes of JSON {name: {dtype, shape,
        data_offsets: [begin, end) relative to the data, which starts at 8 + n}}."""
        info = os.fstat(self.fd)
        if not stat.S_ISREG(info.st_mode):
            raise self._error("not a regular file")
        if info.st_size < 8:
            raise self._error(f"{info.st_size} bytes, shorter than the header's length")
        length = int.from_bytes(os.pread(self.fd, 8, 0), "little")
        if length > min(MAX_HEADER_BYTES, info.st_size - 8):
            raise self._error(f"header length {length} exceeds the file ({info.st_size} bytes) or the limit")
        try:
            header = json.loads(os.pread(self.fd, length, 8))
        except (ValueError, RecursionError) as e:
            raise self._error(f"header is not JSON: {e}") from None
        if not isinstance(header, dict):
            raise self._error("header is not a JSON object")
        data_start, data_bytes = 8 + length, info.st_size - 8 - length
        tensors = {}
        for name, entry in header.items():
            if name != "__metadata__":
                tensors[name] = self._stored(name, entry, data_start, data_bytes)
        return tensors

    def _stored(self, name: str, entry, data_start: int, data_bytes: int) -> StoredTensor:
        def is_count(x) -> bool:
            return isinstance(x, int) and not isinstance(x, bool) and x >= 0
        entry = entry if isinstance(entry, dict) else {}
        dtype_name, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if (not isinstance(dtype_name, str) or not isinstance(shape, list) or not all(map(is_count, shape))
                or not isinstance(offsets, list) or len(offsets) != 2 or not all(map(is_count, offsets))):
            raise self._error(f"tensor {name!r}: malformed header entry")
        begin, end = offsets
        dtype = SAFETENSORS_DTYPES.get(dtype_name)
        if not begin <= end <= data_bytes or (dtype is not None and end - begin != math.prod(shape) * dtype.itemsize):
            raise self._error(f"tensor {name!r}: data_offsets {offsets} do not fit its shape {shape} or the file")
        return StoredTensor(name, self.path, dtype, dtype_name, tuple(shape), data_start + begin)

    def pread_into(self, buffer: memoryview, offset: int) -> None:
        while len(buffer):
            n = os.preadv(self.fd, [buffer], offset)
            if n <= 0:
                raise OSError(f"the file ends at byte {offset}")
            buffer, offset = buffer[n:], offset + n

    def view(self, stored: StoredTensor) -> torch.Tensor:
        """A whole stored tensor without a copy: a private (copy-on-write) mapping of its bytes, paged
        in on first use, as safetensors' own loader gives.

        NOTE: one mapping per tensor (from the page holding its first byte), not one per file: a
        mapping lives while any tensor views it, so with one per file a single small tensor kept
        (a norm) held every page of the file that was ever read, such as those of a weight the
        runtime repacked and dropped. The page a tensor shares with its neighbour is then mapped
        twice (the same page of memory)."""
        count = math.prod(stored.shape)
        if not count:
            return torch.empty(stored.shape, dtype=stored.dtype)
        start = stored.offset - stored.offset % mmap.ALLOCATIONGRANULARITY
        mapped = mmap.mmap(self.fd, stored.offset - start + count * stored.dtype.itemsize, access=mmap.ACCESS_COPY,
                           offset=start)
        return torch.frombuffer(mapped, dtype=stored.dtype, count=count, offset=stored.offset - start
                                ).view(stored.shape)

    def close(self) -> None:
        os.close(self.fd)   # a mapping (and the tensors viewing it) outlives the descriptor


class TensorSource:
    """The tensors of one or more safetensors files, by name: `get` gives a LazyTensor, `read` its
    data (whole, or the spans of one dim); `num_bytes_read` counts the tensor bytes read (headers
    not counted). Use as a context manager (closes the files)."""

    def __init__(self, directory: str):
        self.directory = directory
        self.name_to_file: dict[str, str] = {}
        self._files: dict[str, _File] = {}
        self.num_bytes_read = 0
        index_path = os.path.join(directory, "model.safetensors.index.json")
        if os.path.exists(index_path):
            weight_map = read_json(index_path, "model.safetensors.index.json").get("weight_map")
            if not isinstance(weight_map, dict):
                raise WeightError(f"{index_path}: missing 'weight_map'")
            for name, file in weight_map.items():
                path = os.path.join(directory, os.path.basename(str(file)))
                self.name_to_file[name] = path
        else:
            files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
            if not files:
                pickles = [f for f in os.listdir(directory) if f.endswith((".bin", ".pt", ".pth", ".ckpt"))]
                hint = (f" (found {', '.join(sorted(pickles))}: pickle checkpoints are never loaded; "
                        "convert them to safetensors)") if pickles else ""
                raise WeightError(f"{directory}: no *.safetensors weights{hint}")
            for path in files:
                for name in self._file(path).tensors:
                    self.name_to_file[name] = path

    def __enter__(self) -> "TensorSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for file in self._files.values():
            file.close()
        self._files.clear()

    def _file(self, path: str) -> _File:
        if path not in self._files:
            self._files[path] = _File(path)
        return self._files[path]

    def names(self) -> set[str]:
        return set(self.name_to_file)

    def get(self, name: str) -> LazyTensor:
        path = self.name_to_file.get(name)
        if path is None:
            raise WeightError(f"missing tensor {name!r} in {self.directory}")
        stored = self._file(path).tensors.get(name)
        if stored is None or stored.dtype is None:
            reason = "not in the file's header" if stored is None else f"unsupported dtype {stored.dtype_name!r}"
            raise WeightError(f"tensor {name!r} in {path}: cannot read: {reason}")
        return LazyTensor((RowRun(stored, 0, stored.num_rows),), stored.shape[1:], stored.dtype)

    def read(self, tensor: LazyTensor, selection: tuple[int, Ranges] | None = None) -> torch.Tensor:
        """The data of `tensor` in its dtype: whole (selection None), or the concatenation along
        `dim` of its [start, stop) spans (dim, spans), reading only those bytes."""
        if tensor.transposed:
            inner = None if selection is None else (1 - selection[0], selection[1])
            return self.read(tensor.t(), inner).t()
        runs, columns = tensor.runs, None
        if selection is not None and selection[0] == 0:
            runs = tensor.take_rows(selection[1]).runs
        elif selection is not None:
            assert selection[0] == 1 and len(tensor.row_shape) == 1, f"selection {selection} of {tensor.shape}"
            columns = None if tuple(selection[1]) == ((0, tensor.row_shape[0]),) else tuple(selection[1])
        parts = [self._read_runs(list(group), columns)
                 for _, group in itertools.groupby(runs, key=lambda run: run.stored.dtype)]
        if len(parts) == 1:
            return parts[0]
        row_shape = tensor.row_shape if columns is None else (sum(stop - start for start, stop in columns),)
        if not parts:
            return torch.empty((0, *row_shape), dtype=tensor.dtype)
        return torch.cat([part.to(tensor.dtype) for part in parts])

    def _read_runs(self, runs: list[RowRun], columns: Ranges | None) -> torch.Tensor:
        """Rows of stored tensors of one dtype, all columns or the `columns` spans of 2-D ones.

        NOTE: a column span costs one read per row (rows are contiguous, their spans are not); whole
        rows cost one read per run of rows. A whole stored tensor is mapped instead of copied."""
        first = runs[0].stored
        if columns is None and len(runs) == 1 and (runs[0].start, runs[0].stop) == (0, first.num_rows):
            self.num_bytes_read += math.prod(first.shape) * first.dtype.itemsize
            return self._file(first.path).view(first)
        itemsize = first.dtype.itemsize
        reads: list[tuple[StoredTensor, int, int]] = []   # (tensor, file offset, bytes), in output order
        if columns is None:
            for run in runs:
                row_bytes = run.stored.row_bytes
                _append_read(reads, run.stored, run.stored.offset + run.start * row_bytes,
                             (run.stop - run.start) * row_bytes)
            row_shape = first.shape[1:]
        else:
            for run in runs:
                row_bytes = run.stored.row_bytes
                for row in range(run.start, run.stop):
                    for start, stop in columns:
                        _append_read(reads, run.stored, run.stored.offset + row * row_bytes + start * itemsize,
                                     (stop - start) * itemsize)
            row_shape = (sum(stop - start for start, stop in columns),)
        shape = (sum(run.stop - run.start for run in runs), *row_shape)
        num_bytes = sum(n for _, _, n in reads)
        if not num_bytes:
            return torch.empty(shape, dtype=first.dtype)
        # NOTE: torch.empty, not bytearray: no zero fill (a fresh process loads ~7% faster).
        buffer = torch.empty(num_bytes, dtype=torch.uint8)
        view, position = memoryview(buffer.numpy()), 0
        for stored, offset, n in reads:
            try:
                self._file(stored.path).pread_into(view[position:position + n], offset)
            except OSError as e:
                raise WeightError(f"tensor {stored.name!r} in {stored.path}: cannot read: {e}") from None
            position += n
        self.num_bytes_read += num_bytes
        return buffer.view(first.dtype).view(shape)


def _append_read(reads: list[tuple[StoredTensor, int, int]], stored: StoredTensor, offset: int,
                 num_bytes: int) -> None:
    """Append, merging with the last read when it continues it in the same file."""
    if reads and reads[-1][0].path == stored.path and reads[-1][1] + reads[-1][2] == offset:
        reads[-1] = (reads[-1][0], reads[-1][1], reads[-1][2] + num_bytes)
    elif num_bytes:
        reads.append((stored, offset, num_bytes))
