"""Fixtures for end-to-end GptManager tests: a tiny engine, transformers references, a client."""
from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from batch_manager import InferenceRequest, tensor_names
from runtime import build_engine
from tests.factories import make_checkpoint

NUM_NEW_TOKENS = 12


@pytest.fixture(scope="session")
def tiny_engine(tmp_path_factory):
    """(engine_dir, transformers model) for a tiny LLaMA with small limits and 4-token blocks."""
    root = tmp_path_factory.mktemp("gpt_manager")
    model = make_checkpoint(root / "hf", "llama")
    build_engine(root / "hf", root / "engine", tokens_per_block=4, max_batch_size=8, max_input_len=48,
                 max_seq_len=96, max_num_tokens=128, gather_context_logits=True, gather_generation_logits=True)
    return str(root / "engine"), model


@pytest.fixture(scope="session")
def prompts():
    rng = random.Random(0)
    return {i: [rng.randrange(3, 128) for _ in range(rng.randrange(2, 40))] for i in range(24)}


@pytest.fixture(scope="session")
def references(tiny_engine, prompts):
    """request id -> greedy tokens (prompt + NUM_NEW_TOKENS) from transformers' generate."""
    _, model = tiny_engine
    out = {}
    for i, p in prompts.items():
        ids = model.generate(torch.tensor([p]), max_new_tokens=NUM_NEW_TOKENS, min_new_tokens=NUM_NEW_TOKENS,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
        out[i] = ids[0].tolist()
    return out


def make_request(request_id: int, prompt: list[int], max_new_tokens: int = NUM_NEW_TOKENS,
                 streaming: bool = False, **tensors) -> InferenceRequest:
    r = InferenceRequest(request_id)
    r.input_ids = torch.tensor(prompt, dtype=torch.int32)
    r.max_new_tokens = torch.tensor([[max_new_tokens]], dtype=torch.int32)
    r.is_streaming = streaming
    for name, value in tensors.items():
        setattr(r, name, value)
    return r


class Client:
    """Feeds requests through the get callback (optionally arriving at given fetch calls) and
    records every response. Thread-safe: the callbacks run on the worker thread."""

    def __init__(self, requests: list[InferenceRequest], arrival_calls: list[int] | None = None):
        self.lock = threading.Lock()
        self.pending = list(requests)
        self.arrival_calls = list(arrival_calls) if arrival_calls else [0] * len(requests)
        self.num_get_calls = 0
        self.responses: dict[int, list[tuple[dict, bool, str]]] = {}
        self.stats: list[str] = []
        self.stop_ids: set[int] = set()
        self.num_expected = len(requests)
        self.done = threading.Event()

    def get(self, max_num_requests: int) -> list[InferenceRequest]:
        with self.lock:
            self.num_get_calls += 1
            out = []
            while self.pending and len(out) < max_num_requests and self.arrival_calls[0] <= self.num_get_calls:
                out.append(self.pending.pop(0))
                self.arrival_calls.pop(0)
            return out

    def send(self, request_id, tensors, is_final, err_msg) -> None:
        with self.lock:
            self.responses.setdefault(request_id, []).append(({t.name: t.tensor for t in tensors}, is_final, err_msg))
            if sum(1 for rs in self.responses.values() if rs[-1][1]) >= self.num_expected:
                self.done.set()

    def poll_stop(self) -> set[int]:
        with self.lock:
            ids, self.stop_ids = self.stop_ids, set()
            return ids

    def report_stats(self, stats: str) -> None:
        self.stats.append(stats)

    def callbacks(self):
        return self.get, self.send, self.poll_stop, self.report_stats

    def wait(self, timeout_s: float = 60.0) -> None:
        assert self.done.wait(timeout_s), f"timed out; responses for {sorted(self.responses)}"

    def final(self, request_id: int) -> tuple[dict, bool, str]:
        finals = [r for r in self.responses[request_id] if r[1]]
        assert len(finals) == 1, f"request {request_id}: {len(finals)} final responses"
        assert self.responses[request_id][-1][1], "the final response must be the last one"
        return finals[0]

    def final_output_ids(self, request_ids) -> list[list[int]]:
        """Beam 0's output ids of each request's final response, which must carry no error."""
        outputs = []
        for request_id in request_ids:
            tensors, _, err = self.final(request_id)
            assert err == "", err
            outputs.append(tensors[tensor_names.OUTPUT_IDS][0, 0].tolist())
        return outputs


def wait_until(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.002)
    return False


def inject_faults(manager, fault) -> None:
    """The executor's test hook: fault(group), called with each forward group (a tuple of
    ScheduledRequests) before its forward, fails exactly that group by raising."""
    manager.model_executor.fault_injector = fault
