"""samples.microbench.decode_step runs end to end on the random model: every figure of a mode is
timed, and --kv-cache-dtype reaches the engines it builds."""
from __future__ import annotations

import pytest

from runtime.kernels.cpu import cpu_decode_step
from samples.default_model import random_model_dir
from samples.microbench import decode_step


@pytest.mark.parametrize("kv, expected", [("auto", "float32"), ("int8", "int8")])
def test_a_mode_is_timed_with_the_kv_cache_asked_for(kv, expected):
    if cpu_decode_step.library() is None:
        pytest.skip("the fused decode step's library did not build here")
    results = decode_step.main(["--model", random_model_dir(), "--modes", "fp32", "--rows", "2", "--prompt", "8",
                                "--steps", "4", "--threads", "1", "--kv-cache-dtype", kv])
    row = results[("fp32", 2)]
    assert row["kv_dtype"] == expected
    assert all(row[name] > 0 for name in ("eager", "fused", "matmuls"))
