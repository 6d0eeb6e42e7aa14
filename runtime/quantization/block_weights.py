"""Block weights in a weights dict: a canonical matmul weight `W` (`layers.0.qkv.weight`, `lm_head`,
`embed_tokens`) kept in llama.cpp's block formats (gguf_blocks.py) is held as one or more ROW
SEGMENTS, each a uint8 [rows, row_bytes] tensor named `W@<index>.<format>`
(`layers.0.qkv.weight@0.q4_k`, `layers.0.qkv.weight@1.q6_k`): segment i holds the next rows of
W after segments 0..i-1, in its own format. A fused weight whose GGUF parts share a format is
one segment; parts in different formats (Q4_K_M: attn_v in Q6_K beside attn_q / attn_k in Q4_K)
are one segment each, and the prepared linear writes each segment's columns of the output.

So a weights dict says by its names which weights are blocks and in which format, wherever it
travels (tensor-parallel slicing, pipeline stages, the model); engine.json's "weight_formats"
records the same per weight (`W -> format`, or `W -> [[format, rows], ...]` for several
segments) so that a loader can check a file's tensors before it reads them. Torch only.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from .format import Ranges
from .gguf_blocks import BlockFormat, block_format

SEGMENT_MARK = "@"
# the canonical weights that may be held as blocks: the matmuls and the embedding table
BLOCK_WEIGHT_SUFFIXES = (".qkv.weight", ".out.weight", ".mlp_in.weight", ".mlp_out.weight")
BLOCK_WEIGHT_NAMES = ("embed_tokens", "lm_head")
# format -> rows of one segment, in order; a whole weight's record in engine.json
FormatRecord = str | list[list]


def can_hold_blocks(name: str) -> bool:
    return name in BLOCK_WEIGHT_NAMES or (name.startswith("layers.") and name.endswith(BLOCK_WEIGHT_SUFFIXES))


def segment_name(base: str, index: int, fmt: BlockFormat) -> str:
    return f"{base}{SEGMENT_MARK}{index}.{fmt.name}"


def parse_segment(name: str) -> tuple[str, int, BlockFormat] | None:
    """(the weight's canonical name, segment index, its format) of a segment name; None for any
    other name. ConfigError naming the tensor for a segment name with an unknown format."""
    base, mark, rest = name.rpartition(SEGMENT_MARK)
    if not mark:
        return None
    index, _, fmt = rest.partition(".")
    if not index.isdigit():
        raise ConfigError(f"tensor {name!r}: not a block segment name (expected <weight>@<index>.<format>)")
    return base, int(index), block_format(fmt, f"tensor {name!r}")


def is_segment(name: str) -> bool:
    return SEGMENT_MARK in name


def segments_of(names: Iterable[str], base: str) -> list[tuple[str, BlockFormat]]:
    """(name, format) of each segment of `base` among `names`, in row order (empty: not blocks)."""
    found = []
    for name in names:
        if name.startswith(base + SEGMENT_MARK):
            _, index, fmt = parse_segment(name)
            found.append((index, name, fmt))
    found.sort()
    return [(name, fmt) for _, name, fmt in found]


def block_bases(names: Iterable[str]) -> list[str]:
    """The canonical names of the block weights among `names`, in first-seen order."""
    return list(dict.fromkeys(parse_segment(n)[0] for n in names if is_segment(n)))


def has_weight(names: Iterable[str], base: str) -> bool:
    """Whether `base` is held, as a float / weight-only tensor or as block segments."""
    names = list(names)
    return base in names or any(n.startswith(base + SEGMENT_MARK) for n in names)


def segment_row_offset(name: str, shapes: Mapping[str, tuple[int, ...]]) -> int:
    """The first row of W that segment `name` holds (rows of the segments before it in `shapes`)."""
    base, index, _ = parse_segment(name)
    return sum(shapes[other][0] for other, _ in segments_of(shapes, base)
               if parse_segment(other)[1] < index)


def weight_formats(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, FormatRecord]:
    """engine.json's "weight_formats" of the block weights among `shapes` (name -> shape)."""
    record: dict[str, FormatRecord] = {}
    for base in block_bases(shapes):
        segments = segments_of(shapes, base)
        record[base] = (segments[0][1].name if len(segments) == 1
                        else [[fmt.name, shapes[name][0]] for name, fmt in segments])
    return record


def stored_block_layout(record: object, expected: Mapping[str, tuple[int, ...]], where: str
                        ) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """segment name -> (uint8, its shape) of engine.json's "weight_formats" `record`, each weight's
    rows and columns checked against `expected` (canonical name -> float shape): ConfigError
    naming the weight for an unknown weight or format, rows that do not add up or a column count
    that is not whole blocks."""
    if not isinstance(record, dict):
        raise ConfigError(f"{where}: weight_formats: expected an object, got {type(record).__name__}")
    layout = {}
    for base, entry in record.items():
        if base not in expected or not can_hold_blocks(base):
            raise ConfigError(f"{where}: weight_formats: {base!r} is not a matmul weight of this model")
        rows, columns = expected[base]
        segments = [[entry, rows]] if isinstance(entry, str) else entry
        if not isinstance(segments, list) or not all(isinstance(s, list) and len(s) == 2 for s in segments):
            raise ConfigError(f"{where}: weight_formats: {base!r}: expected a format or [[format, rows], ...]")
        counts = [n for _, n in segments]
        if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in counts) or sum(counts) != rows:
            raise ConfigError(f"{where}: weight_formats: {base!r}: segment rows {counts} are not positive counts that "
                              f"add up to its {rows} rows")
        for index, (fmt_name, num_rows) in enumerate(segments):
            fmt = block_format(fmt_name, f"{where}: weight_formats: {base!r}")
            fmt.check_columns(columns, base)
            layout[segment_name(base, index, fmt)] = (torch.uint8, (num_rows, fmt.row_bytes(columns)))
    return layout


def segment_spans(name: str, dim: int, spans: Ranges, shapes: Mapping[str, tuple[int, ...]], size: int
                  ) -> Ranges:
    """Of the float weight's spans along `dim` a tensor-parallel rank holds: segment `name`'s own.
    Rows (dim 0): the spans inside the segment's rows, from its first row. Columns (dim 1): the
    byte spans of whole blocks; ConfigError naming the weight where a span would cut a block."""
    base, _, fmt = parse_segment(name)
    if dim == 0:
        first = segment_row_offset(name, shapes)
        last = first + shapes[name][0]
        inside = ((max(start, first) - first, min(stop, last) - first) for start, stop in spans)
        return tuple((start, stop) for start, stop in inside if stop > start)
    for start, stop in spans:
        if start % fmt.block_elems or stop % fmt.block_elems:
            raise ConfigError(f"tensor {base!r}: {size} tensor-parallel ranks would split its {fmt.name} blocks of "
                              f"{fmt.block_elems} columns (a rank's columns {start}..{stop}); use fewer ranks or "
                              "--weight-format dequantize")
    return tuple((start // fmt.block_elems * fmt.block_bytes, stop // fmt.block_elems * fmt.block_bytes)
                 for start, stop in spans)


def padded_segments(weights: Mapping[str, torch.Tensor], base: str, num_rows: int) -> dict[str, torch.Tensor]:
    """`base`'s segments with `num_rows` zero rows appended to the last: all-zero blocks hold
    zero scales in every format, so the rows compute 0 (a rank's lm_head padded to the vocabulary chunk)."""
    segments = segments_of(weights, base)
    out = {name: weights[name] for name, _ in segments}
    last = segments[-1][0]
    out[last] = F.pad(out[last], (0, 0, 0, num_rows))
    return out


def dequantize_segments(weights: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`weights` with every block weight de-quantized back under its canonical name, in `dtype`."""
    out = {name: t for name, t in weights.items() if not is_segment(name)}
    for base in block_bases(weights):
        out[base] = torch.cat([fmt.dequantize(weights[name]) for name, fmt in segments_of(weights, base)]).to(dtype)
    return out


def dequantize_rows(weights: Mapping[str, torch.Tensor], base: str, ids: torch.Tensor) -> torch.Tensor:
    """float32 [len(ids), columns]: rows `ids` of block weight `base`, only those de-quantized (the
    embedding lookup; one segment, as a GGUF stores token_embd)."""
    (name, fmt), = segments_of(weights, base)
    return fmt.dequantize(weights[name][ids])
