"""samples.serve's GptManager-bridge admission (load_admission): the same refusals as the
Executor's enqueue, exactly: queue size and prompt tokens waiting, the time-to-first-token
budget once the context rate is measured, each with retry_after_s; the flags that set them."""
from __future__ import annotations

import pytest

from batch_manager.executor import QueueFullError
from samples.serve.load_admission import BridgeAdmission
from samples.serve.launch import parse_args


def measured(admission: BridgeAdmission, tokens_per_step: int, step_s: float, num_steps: int = 3) -> None:
    """Steps of the given context tokens, timed by replacing the clock reads."""
    for _ in range(num_steps):
        admission._step_start_s -= step_s   # the step began step_s ago
        admission.step_ended(tokens_per_step)
        admission.step_began()


def test_queue_size_and_queued_tokens():
    admission = BridgeAdmission(max_queue_size=2, max_num_queued_tokens=100)
    admission.admit(1, 60)
    with pytest.raises(QueueFullError, match=r"max_num_queued_tokens=100, 60 prompt tokens waiting, 50 more") as e:
        admission.admit(2, 50)
    assert e.value.retry_after_s is None   # no rate measured yet
    with pytest.raises(ValueError, match=r"input_ids: 101 tokens, more than this server's max_num_queued_tokens"):
        admission.admit(3, 101)
    admission.admit(4, 40)
    with pytest.raises(QueueFullError, match=r"max_queue_size=2"):
        admission.admit(5, 1)
    admission.fetched(1)
    admission.admit(6, 50)   # 1 was fetched: its tokens left the queue


def test_ttft_budget_after_the_warm_up():
    admission = BridgeAdmission(ttft_budget_ms=1000.0)
    admission.admit(1, 5000)                      # unmeasured: admitted whatever the prediction
    measured(admission, 1000, 1.0)                # 1 skipped, 2 measured: 1000 tokens/s
    with pytest.raises(QueueFullError, match=r"5000 context tokens ahead and 10 of its own at 1000") as e:
        admission.admit(2, 10)
    # (the real clock also runs between the faked steps' reads: microseconds, 4e-6 of it seen)
    assert e.value.retry_after_s == pytest.approx(4.01, rel=1e-4)
    admission.fetched(1)
    admission.first_token(1)                      # its context is done
    admission.admit(3, 900)                       # 0.9 s: fits
    admission.cancelled(3)
    admission.admit(4, 990)


def test_flags():
    args = parse_args(["--max-num-queued-tokens", "4096", "--ttft-budget-ms", "250.5"])
    assert (args.max_num_queued_tokens, args.ttft_budget_ms) == (4096, 250.5)
    for bad in (["--ttft-budget-ms", "0"], ["--ttft-budget-ms", "nan"], ["--max-num-queued-tokens", "-1"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
