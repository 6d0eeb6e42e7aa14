"""A context instance in its own process for the disaggregated tests: an Executor on the given
engine that runs context-only requests sent over a multiprocessing pipe and answers with their
final results (plain values) and its KV pool's state."""
from __future__ import annotations

import multiprocessing
import time
from datetime import timedelta

from batch_manager import load_peft_adapter
from batch_manager.executor import (Executor, ExecutorConfig, KvCacheConfig, LoraConfig, OutputConfig, Request,
                                    RequestType, SamplingConfig)


def context_request(spec: dict, adapters: dict) -> Request:
    """spec: prompt, max_tokens, streaming, lora (a PEFT directory or None), task_id, sampling (dict)."""
    lora = None
    if spec.get("lora") is not None:
        if spec["lora"] not in adapters:
            adapters[spec["lora"]] = load_peft_adapter(spec["lora"])
        lora = LoraConfig(spec["task_id"], *adapters[spec["lora"]])
    return Request(spec["prompt"], spec["max_tokens"], streaming=spec.get("streaming", False),
                   sampling_config=SamplingConfig(**spec.get("sampling", {})),
                   output_config=OutputConfig(return_log_probs=True), lora_config=lora,
                   request_type=RequestType.REQUEST_TYPE_CONTEXT_ONLY)


def final_values(responses: list) -> dict:
    if responses[-1].has_error():
        return {"error": responses[-1].error_msg}
    results = [r.result for r in responses]
    final = results[-1]
    return {"num_results": len(results), "tokens": [t for r in results for t in r.output_token_ids[0]],
            "finish_reasons": [int(f) for f in final.finish_reasons], "cum_log_prob": float(final.cum_log_probs[0]),
            "params": None if final.context_phase_params is None else final.context_phase_params.to_bytes()}


def serve(engine_dir: str, connection, timeout_ms: int = 60000) -> None:
    adapters: dict = {}
    config = ExecutorConfig(kv_cache_config=KvCacheConfig(max_tokens=400), kv_transfer_timeout_ms=timeout_ms)
    with Executor(engine_dir, executor_config=config) as executor:
        connection.send("ready")
        while True:
            message = connection.recv()
            if message[0] == "exit":
                break
            if message[0] == "kv":   # once no transfer is pending: (free blocks, blocks, reserved exports)
                kv, deadline = executor.kv_cache_manager, time.monotonic() + message[1]
                while executor.get_bookkeeping_counts()["kv_exports"] and time.monotonic() < deadline:
                    time.sleep(0.01)
                connection.send((kv.num_free_blocks, kv.num_blocks, executor.get_bookkeeping_counts()["kv_exports"]))
                continue
            ids = executor.enqueue_requests([context_request(spec, adapters) for spec in message[1]])
            connection.send([final_values(await_final(executor, i)) for i in ids])


def await_final(executor: Executor, request_id: int) -> list:
    """Every response of `request_id` up to its final (or error) one."""
    responses = []
    while not responses or not (responses[-1].has_error() or responses[-1].result.is_final):
        got = executor.await_responses(request_id, timedelta(seconds=60))
        assert got, f"request {request_id}: no response in 60 s"
        responses += got
    return responses


def start(engine_dir: str, timeout_ms: int = 60000):
    """-> (process, connection) once its Executor is ready."""
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=serve, args=(engine_dir, child, timeout_ms), daemon=True)
    process.start()
    if not parent.poll(180):
        process.kill()
        raise RuntimeError("the context instance did not start in 180 s")
    assert parent.recv() == "ready"
    return process, parent
