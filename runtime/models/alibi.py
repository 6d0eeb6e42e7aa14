"""ALiBi (attention with linear biases): the per-head slopes.

A query at position p adds slope_h * (k - p) to its score for the key at position k (<= 0 for
every visible key). Under the softmax this equals adding slope_h * k, the absolute key position,
as BLOOM does: the two differ by a constant per query. The kernels use the relative form, whose
biases stay small however long the sequence.
"""
from __future__ import annotations

import math

import torch


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """float32 [num_heads]: the geometric sequence 2^(-8 i / n) for the closest power of two
    n <= num_heads, then, for the remaining heads, every other slope of the sequence for 2 n
    (Press et al.; computed in the order and dtype of BLOOM's reference so the values match)."""
    if not isinstance(num_heads, int) or num_heads <= 0:
        raise ValueError(f"num_heads: must be a positive integer, got {num_heads!r}")
    closest_power_of_2 = 2 ** math.floor(math.log2(num_heads))
    base = torch.tensor(2 ** (-(2 ** -(math.log2(closest_power_of_2) - 3))), dtype=torch.float32)
    powers = torch.arange(1, 1 + closest_power_of_2, dtype=torch.int32)
    slopes = torch.pow(base, powers)
    if closest_power_of_2 != num_heads:
        extra_base = torch.tensor(2 ** (-(2 ** -(math.log2(2 * closest_power_of_2) - 3))), dtype=torch.float32)
        num_remaining = min(closest_power_of_2, num_heads - closest_power_of_2)
        extra_powers = torch.arange(1, 1 + 2 * num_remaining, 2, dtype=torch.int32)
        slopes = torch.cat([slopes, torch.pow(extra_base, extra_powers)])
    return slopes
