"""Helpers for Executor tests: the bindings' usage loop and a GptManager run of the same requests."""
from __future__ import annotations

import time
from datetime import timedelta

import torch

from batch_manager import GptManager, KvCacheConfig, SchedulerPolicy, TrtGptModelOptionalParams, TrtGptModelType
from batch_manager import tensor_names as tn
from batch_manager.executor import Executor, ExecutorConfig
from tests.batch_manager.conftest import Client, make_request


def collect(executor: Executor, request_ids, timeout_s: float = 60.0) -> dict[int, list]:
    """The loop of the bindings' examples: await any responses until every id saw is_final."""
    responses = {i: [] for i in request_ids}
    pending = set(request_ids)
    deadline = time.monotonic() + timeout_s
    while pending:
        assert time.monotonic() < deadline, f"no final response for {sorted(pending)}"
        for response in executor.await_responses(timeout=timedelta(milliseconds=100)):
            responses.setdefault(response.request_id, []).append(response)
            if response.has_error() or response.result.is_final:
                pending.discard(response.request_id)
    return responses


def final_tokens(responses: list, streaming: bool) -> list[list[int]]:
    """Per beam: a final result's tokens, or the concatenation of a width-1 stream."""
    assert not any(r.has_error() for r in responses), [r.error_msg for r in responses]
    finals = [r for r in responses if r.result.is_final]
    assert len(finals) == 1 and responses[-1].result.is_final
    if streaming and len(finals[0].result.output_token_ids) == 1:
        return [[t for r in responses for t in r.result.output_token_ids[0]]]
    return finals[0].result.output_token_ids


def gpt_manager_tokens(engine_dir: str, requests: list[tuple[list[int], int, dict]], streaming: bool,
                       max_beam_width: int, kv_cache_config: KvCacheConfig) -> list[list[list[int]]]:
    """GptManager's tokens per beam for (prompt, max_new_tokens, tensors) requests."""
    client = Client([make_request(i, prompt, n, streaming=streaming, **tensors)
                     for i, (prompt, n, tensors) in enumerate(requests)])
    params = TrtGptModelOptionalParams(kv_cache_config=kv_cache_config)
    with GptManager(engine_dir, TrtGptModelType.InflightFusedBatching, max_beam_width,
                    SchedulerPolicy.GUARANTEED_NO_EVICT, *client.callbacks(), optional_params=params):
        client.wait()
    out = []
    for i in range(len(requests)):
        tensors_list = [t for t, _, err in client.responses[i]]
        assert all(err == "" for _, _, err in client.responses[i])
        final = tensors_list[-1]
        lengths = final[tn.SEQUENCE_LENGTH][0].tolist()
        if streaming and len(lengths) == 1:
            out.append([[t for tensors in tensors_list for t in tensors[tn.OUTPUT_IDS][0, 0].tolist()]])
        else:
            out.append([final[tn.OUTPUT_IDS][0, b, :n].tolist() for b, n in enumerate(lengths)])
    return out


def beam_tensors(width: int) -> dict:
    return {"beam_width": torch.tensor([width], dtype=torch.int32)} if width > 1 else {}


def executor_for(engine_dir: str, **config) -> Executor:
    return Executor(engine_dir, executor_config=ExecutorConfig(**config))
