"""kv_wire's checks of what a peer sends: NaN and infinite elements counted from the bits of each
KV storage dtype (against torch.isfinite), and nesting depth measured without recursion."""
from __future__ import annotations

import pytest
import torch

from batch_manager.kv_transport import kv_wire
from batch_manager.kv_transport.kv_wire import count_nonfinite, is_nested_deeper
from tests.batch_manager.executor.kv_peers import nested

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float8_e4m3fn": torch.float8_e4m3fn}


@pytest.mark.parametrize("name", list(DTYPES))
def test_nonfinite_elements_are_counted_from_the_bits(name, monkeypatch):
    monkeypatch.setattr(kv_wire, "_CHECK_CHUNK", 64)    # several chunks, the last one partial
    dtype = DTYPES[name]
    values = (torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 100).to(dtype)
    largest = torch.finfo(dtype).max                    # finite, the bits just below the exponent's
    values[[10, 11]] = torch.tensor([largest, -largest]).to(dtype)
    assert count_nonfinite(values.view(torch.uint8), name) == 0
    values[[0, 63, 64, 999]] = float("nan")
    if dtype != torch.float8_e4m3fn:                    # e4m3fn has no infinity
        values[[5, 700]] = torch.tensor([float("inf"), float("-inf")]).to(dtype)
    expected = int((~torch.isfinite(values.float())).sum())
    assert expected == (4 if dtype == torch.float8_e4m3fn else 6)
    assert count_nonfinite(values.view(torch.uint8), name) == expected


def test_an_integer_pool_has_no_nonfinite_elements():
    assert count_nonfinite(torch.full((64,), 0xFF, dtype=torch.uint8), "int8") == 0


def test_nesting_depth():
    assert not is_nested_deeper(5, 0) and is_nested_deeper({"a": 1}, 0) and not is_nested_deeper({"a": 1}, 1)
    assert is_nested_deeper({"a": {"b": [1]}}, 2) and not is_nested_deeper({"a": {"b": [1]}}, 3)
    assert is_nested_deeper(nested(100_000), 8)         # no recursion: Python's limit is 1,000
    assert not is_nested_deeper([[]] * 100_000, 2)
