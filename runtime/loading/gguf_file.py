"""GGUF files (llama.cpp's format), read within their size: `GgufFile(path)` maps the file and walks
its header once, every count, length and offset checked against the file's size before it is used,
so that a hostile header is a ConfigError (metadata) or WeightError (tensor) naming the field or
tensor; then it gives typed metadata values and tensors de-quantized by `gguf.quants.dequantize`
(types and block sizes from the `gguf` package). Nothing in the file is executed. Used by
runtime.loading.gguf_checkpoint (config, weights) and runtime.loading.gguf_tokenizer.

NOTE: `gguf.GGUFReader` is not used: it parses arrays element by element through numpy memmap
views (about 4 s for the header of a 135M model with a 49k vocabulary, where this walk takes 0.1 s)
and trusts the header's counts (a hostile array length loops for ever).
"""
from __future__ import annotations

import math
import mmap
import os
import stat
import struct
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
import torch

from ..config import ConfigError
from .tensor_files import WeightError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)    # version 1 had 32-bit counts
MAX_DIMS = 4                   # ggml's GGML_MAX_DIMS
MAX_DIM = (1 << 63) - 1        # one dim's size (ggml's int64_t ne; torch's sizes)
DEFAULT_ALIGNMENT = 32
HEADER_BYTES = 24              # magic, version, tensor_count, kv_count
# GGUFValueType -> struct format of one little-endian scalar (STRING = 8 and ARRAY = 9 have layouts of their own)
SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B", 10: "<Q", 11: "<q",
                  12: "<d"}
STRING, ARRAY, BOOL = 8, 9, 7
INT_TYPES = {0, 1, 2, 3, 4, 5, 10, 11}
FLOAT_TYPES = {6, 12}
MIN_KV_BYTES = 8 + 4 + 1                 # key length, value type, the smallest value
MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8    # name length, n_dims, type, offset


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the header: `ne` is ggml's dims (innermost first: torch's shape reversed)."""
    name: str
    type_id: int
    ne: tuple[int, ...]
    offset: int        # of its data, from the start of the file
    num_bytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.ne))

    @property
    def type_name(self) -> str:
        return gguf.GGMLQuantizationType(self.type_id).name


class StringArray:
    """A metadata array of strings kept as the file stores them: the bytes of the whole array (a
    copy: each string after its 8-byte length) and where each string starts, 8 bytes an item;
    decoded (and checked as UTF-8) only when read. NOTE: a list of 3M Python strings took 882 MB
    for a 56 MB file; this takes the file's bytes plus 8 a string."""

    def __init__(self, blob: bytes, starts: np.ndarray):
        self._blob, self._starts = blob, starts   # int64 [n + 1]: string i is blob[starts[i]:starts[i + 1] - 8]

    def __len__(self) -> int:
        return len(self._starts) - 1

    def decoded(self, what: str) -> list[str]:
        """Every string (ConfigError naming `what` for one that is not UTF-8)."""
        blob, starts = self._blob, self._starts.tolist()
        try:
            return [blob[start:end - 8].decode("utf-8") for start, end in zip(starts, starts[1:])]
        except UnicodeDecodeError:
            raise ConfigError(f"{what}: not UTF-8 text") from None


@dataclass(frozen=True)
class Value:
    """One metadata value: `value_type` a GGUFValueType; arrays have `item_type` and a compact value
    (a read-only numpy array of scalars, or a StringArray)."""
    value_type: int
    value: Any
    item_type: int | None = None


class _Cursor:
    """Little-endian reads of the mapped file; a read past its end is a ConfigError naming `what`."""

    def __init__(self, data: mmap.mmap, size: int, path: str):
        self.data, self.size, self.path, self.pos = data, size, path, 0

    def take(self, num_bytes: int, what: str) -> int:
        if num_bytes > self.size - self.pos:
            raise ConfigError(f"{self.path}: {what}: needs {num_bytes} bytes at byte {self.pos}, past the end "
                              f"of the file ({self.size} bytes; truncated?)")
        start, self.pos = self.pos, self.pos + num_bytes
        return start

    def scalar(self, value_type: int, what: str):
        fmt = SCALAR_FORMATS[value_type]
        return struct.unpack_from(fmt, self.data, self.take(struct.calcsize(fmt), what))[0]

    def u32(self, what: str) -> int:
        return self.scalar(4, what)

    def u64(self, what: str) -> int:
        return self.scalar(10, what)

    def text(self, what: str) -> str:
        length = self.u64(what)
        start = self.take(length, what)
        try:
            return self.data[start:start + length].decode("utf-8")
        except UnicodeDecodeError:
            raise ConfigError(f"{self.path}: {what}: not UTF-8 text") from None

    def count(self, what: str, min_item_bytes: int) -> int:
        """A count of items of at least `min_item_bytes` each, which must fit in the rest of the file."""
        value = self.u64(what)
        if value * min_item_bytes > self.size - self.pos:
            raise ConfigError(f"{self.path}: {what}: {value} items cannot fit in the {self.size - self.pos} "
                              "bytes left in the file")
        return value


def _read_value(cur: _Cursor, value_type: int, key: str) -> Value:
    what = f"metadata {key!r}"
    if value_type in SCALAR_FORMATS:
        value = cur.scalar(value_type, what)
        return Value(value_type, bool(value) if value_type == BOOL else value)
    if value_type == STRING:
        return Value(value_type, cur.text(what))
    if value_type != ARRAY:
        raise ConfigError(f"{cur.path}: {what}: unknown value type {value_type}")
    item_type = cur.u32(what)
    if item_type == STRING:
        return Value(value_type, _read_strings(cur, what), item_type)
    if item_type not in SCALAR_FORMATS:
        raise ConfigError(f"{cur.path}: {what}: unsupported array item type {item_type}")
    fmt = SCALAR_FORMATS[item_type]
    count = cur.count(what, struct.calcsize(fmt))
    start = cur.take(count * struct.calcsize(fmt), what)
    items = np.frombuffer(cur.data, dtype=np.dtype(fmt), count=count, offset=start)
    items = items.astype(bool) if item_type == BOOL else items.copy()   # a copy: the mapping may close
    items.flags.writeable = False
    return Value(value_type, items, item_type)


def _read_strings(cur: _Cursor, what: str) -> StringArray:
    """The strings of an array, each length checked against the file, kept undecoded."""
    count = cur.count(what, 8)
    first = cur.pos
    starts = np.empty(count + 1, np.int64)
    for i in range(count):
        length = cur.u64(what)
        starts[i] = cur.take(length, what) - first
    starts[count] = cur.pos - first + 8
    return StringArray(bytes(cur.data[first:cur.pos]), starts)


def _read_tensor_info(cur: _Cursor) -> tuple[str, int, tuple[int, ...], int]:
    name = cur.text("tensor name")
    num_dims = cur.u32(f"tensor {name!r}: n_dims")
    if not 1 <= num_dims <= MAX_DIMS:
        raise WeightError(f"{cur.path}: tensor {name!r}: {num_dims} dims, expected 1 to {MAX_DIMS}")
    ne = tuple(cur.u64(f"tensor {name!r}: dims") for _ in range(num_dims))
    return name, cur.u32(f"tensor {name!r}: type"), ne, cur.u64(f"tensor {name!r}: offset")


def _tensor(path: str, raw: tuple[str, int, tuple[int, ...], int], data_start: int, alignment: int,
            size: int) -> TensorInfo:
    name, type_id, ne, offset = raw
    for dim in ne:
        if dim > MAX_DIM:
            raise WeightError(f"{path}: tensor {name!r}: dim {dim} exceeds {MAX_DIM} (torch's int64 sizes)")
    try:
        kind = gguf.GGMLQuantizationType(type_id)
        block_size, type_bytes = gguf.GGML_QUANT_SIZES[kind]
    except (ValueError, KeyError):
        raise WeightError(f"{path}: tensor {name!r}: unknown tensor type {type_id}") from None
    if ne[0] % block_size:
        raise WeightError(f"{path}: tensor {name!r}: rows of {ne[0]} elements are not whole {kind.name} "
                          f"blocks of {block_size}")
    num_bytes = math.prod(ne) // block_size * type_bytes   # Python ints: no overflow
    if offset % alignment:
        raise WeightError(f"{path}: tensor {name!r}: offset {offset} is not a multiple of the alignment {alignment}")
    if data_start + offset + num_bytes > size:
        raise WeightError(f"{path}: tensor {name!r}: its {num_bytes} bytes at offset {offset} (dims {list(ne)}) "
                          f"extend past the end of the file ({size} bytes)")
    return TensorInfo(name, type_id, ne, data_start + offset, num_bytes)


def read_header(data: mmap.mmap, size: int, path: str) -> tuple[dict[str, Value], dict[str, TensorInfo]]:
    """(key -> Value, name -> TensorInfo) of a mapped GGUF file, every read checked against `size`."""
    if size < HEADER_BYTES:
        raise ConfigError(f"{path}: not a GGUF file: {size} bytes, shorter than a GGUF header")
    if data[:4] != GGUF_MAGIC:
        raise ConfigError(f"{path}: magic: {bytes(data[:4])!r} is not {GGUF_MAGIC!r} (not a GGUF file)")
    cur = _Cursor(data, size, path)
    cur.take(4, "magic")
    version = cur.u32("version")
    if version not in SUPPORTED_VERSIONS:
        swapped = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
        raise ConfigError(f"{path}: version: unsupported {version}{swapped}; supported: {SUPPORTED_VERSIONS}")
    num_tensors, num_kv = cur.u64("tensor_count"), cur.u64("kv_count")
    for name, count, min_bytes in (("tensor_count", num_tensors, MIN_TENSOR_INFO_BYTES),
                                   ("kv_count", num_kv, MIN_KV_BYTES)):
        if count * min_bytes > size - cur.pos:
            raise ConfigError(f"{path}: {name}: {count} entries cannot fit in a file of {size} bytes")
    metadata: dict[str, Value] = {}
    for _ in range(num_kv):
        key = cur.text("metadata key")
        if key in metadata:
            raise ConfigError(f"{path}: metadata {key!r}: duplicate key")
        metadata[key] = _read_value(cur, cur.u32(f"metadata {key!r}"), key)
    alignment = metadata.get("general.alignment", Value(4, DEFAULT_ALIGNMENT))
    if alignment.value_type != 4 or alignment.value <= 0 or alignment.value & (alignment.value - 1):
        raise ConfigError(f"{path}: general.alignment: must be a uint32 power of two, got {alignment.value!r}")
    raws = [_read_tensor_info(cur) for _ in range(num_tensors)]
    data_start = -(-cur.pos // alignment.value) * alignment.value
    tensors: dict[str, TensorInfo] = {}
    for raw in raws:
        if raw[0] in tensors:
            raise WeightError(f"{path}: tensor {raw[0]!r}: duplicate name")
        tensors[raw[0]] = _tensor(path, raw, data_start, alignment.value, size)
    return metadata, tensors


def _map(path: str) -> tuple[mmap.mmap | None, int, int]:
    """A read-only mapping of a regular file (None when empty), its size and its open descriptor
    (kept to see the size again before each tensor read). O_NONBLOCK: opening a FIFO returns at
    once (and fstat refuses it) where a plain open would wait for a writer."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the GGUF file: {e}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"{path}: cannot read the GGUF file: not a regular file")
        return (mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if info.st_size else None), info.st_size, fd
    except BaseException as e:
        os.close(fd)
        if isinstance(e, OSError):
            raise ConfigError(f"{path}: cannot read the GGUF file: {e}") from None
        raise


class GgufFile:
    """One GGUF file: `metadata` (key -> Value), `tensors` (name -> TensorInfo), typed metadata getters
    (None when absent; ConfigError naming the key for a value of another type) and `read` (a tensor
    de-quantized); `num_bytes_read` counts the tensor bytes read."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._data, size, self._fd = _map(self.path)
        try:
            self.metadata, self.tensors = read_header(self._data if self._data is not None else b"", size, self.path)
        except BaseException:
            self.close()
            raise
        self.num_bytes_read = 0

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)

    def __enter__(self) -> "GgufFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Unmap the file (tensors already read are copies and stay valid)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._data is not None:
            try:
                self._data.close()
            except BufferError:   # a view of it is still alive somewhere: the mapping goes with it
                pass

    # -- metadata --------------------------------------------------------------------------------

    def _get(self, key: str, value_types: set[int], is_array: bool, what: str):
        """The value of `key` (None when absent): a scalar of one of `value_types`, or an array of them."""
        entry = self.metadata.get(key)
        if entry is None:
            return None
        if is_array and entry.value_type == ARRAY and not len(entry.value):
            return []
        kind = entry.value_type if not is_array else (entry.item_type if entry.value_type == ARRAY else None)
        if kind not in value_types:
            raise ConfigError(f"{self.path}: metadata {key!r}: expected {what}, got value type {entry.value_type}"
                              + (f" of {entry.item_type}" if entry.item_type is not None else ""))
        if isinstance(entry.value, StringArray):
            return entry.value.decoded(f"{self.path}: metadata {key!r}")
        return entry.value.tolist() if isinstance(entry.value, np.ndarray) else entry.value

    def num_items(self, key: str) -> int | None:
        """The length of array `key` (None when absent or not an array), without decoding it."""
        entry = self.metadata.get(key)
        return len(entry.value) if entry is not None and entry.value_type == ARRAY else None

    def get_int(self, key: str) -> int | None:
        return self._get(key, INT_TYPES, False, "an integer")

    def get_float(self, key: str) -> float | None:
        value = self._get(key, INT_TYPES | FLOAT_TYPES, False, "a number")
        return None if value is None else float(value)

    def get_bool(self, key: str) -> bool | None:
        return self._get(key, {BOOL}, False, "a bool")

    def get_str(self, key: str) -> str | None:
        return self._get(key, {STRING}, False, "a string")

    def get_str_list(self, key: str) -> list[str] | None:
        return self._get(key, {STRING}, True, "an array of strings")

    def get_int_list(self, key: str) -> list[int] | None:
        return self._get(key, INT_TYPES, True, "an array of integers")

    def get_float_list(self, key: str) -> list[float] | None:
        value = self._get(key, INT_TYPES | FLOAT_TYPES, True, "an array of numbers")
        return None if value is None else [float(v) for v in value]

    # -- tensors ---------------------------------------------------------------------------------

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes of tensor `name` as gguf.quants lays them out: uint8 [*shape[:-1], row bytes]
        (a read-only view of the mapping)."""
        info = self.tensors[name]
        self._check_still_whole(info)
        byte_shape = gguf.quants.quant_shape_to_byte_shape(info.shape, gguf.GGMLQuantizationType(info.type_id))
        return np.frombuffer(self._data, dtype=np.uint8, count=info.num_bytes, offset=info.offset).reshape(byte_shape)

    def _check_still_whole(self, info: TensorInfo) -> None:
        """WeightError naming the tensor when the file no longer holds its bytes: a read of a mapped
        page past the end of a file truncated since it was mapped kills the process (SIGBUS).
        NOTE: a truncation between this check and the copy still does (README "GGUF files")."""
        size = os.fstat(self._fd).st_size if self._fd is not None else 0
        if info.offset + info.num_bytes > size:
            raise WeightError(f"{self.path}: tensor {info.name!r}: its bytes at offset {info.offset} are past the "
                              f"end of the file, now {size} bytes (truncated while loaded?)")

    def read(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Tensor `name` de-quantized (gguf.quants.dequantize), in torch's dim order, as `dtype`."""
        info = self.tensors.get(name)
        if info is None:
            raise WeightError(f"{self.path}: missing tensor {name!r}")
        if info.num_bytes == 0:
            return torch.empty(info.shape, dtype=dtype)
        try:
            values = gguf.quants.dequantize(self.raw(name), gguf.GGMLQuantizationType(info.type_id))
        except NotImplementedError:
            raise WeightError(f"{self.path}: tensor {name!r}: type {info.type_name} cannot be de-quantized") from None
        if not np.issubdtype(values.dtype, np.floating):
            raise WeightError(f"{self.path}: tensor {name!r}: type {info.type_name} is not a floating-point type")
        self.num_bytes_read += info.num_bytes
        if not values.flags.writeable:   # F32 de-quantizes to a view of the mapping: copy it out
            values = values.copy()
        values = values.astype(np.float32, copy=False).reshape(info.shape)
        return torch.from_numpy(values).to(dtype)
