"""Quick start: a GptManager serving loop with the four callbacks, on the default model.

The default model (a random-weight ~57M LLaMA-style checkpoint) is written on first run; pass
--model to use any HF checkpoint or engine directory instead.

    python -m samples.quickstart [--model DIR] [--requests 32] [--max-new-tokens 32]
"""
from __future__ import annotations

import argparse
import json
import queue
import random
import threading
import time

import torch

from batch_manager import (GptManager, InferenceRequest, SchedulerPolicy, TrtGptModelOptionalParams,
                           TrtGptModelType, tensor_names)
from samples.default_model import default_model_dir


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF checkpoint or engine directory (default: the random LLaMA-style model)")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-prompt-len", type=int, default=128)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--batching", default="InflightFusedBatching", choices=[t.name for t in TrtGptModelType])
    p.add_argument("--policy", default="GUARANTEED_NO_EVICT", choices=[s.name for s in SchedulerPolicy])
    args = p.parse_args()
    model_dir = args.model or default_model_dir()
    print(f"model: {model_dir}")

    rng = random.Random(0)
    incoming: queue.Queue[InferenceRequest] = queue.Queue()  # what a server's handlers would fill
    for request_id in range(args.requests):
        r = InferenceRequest(request_id)
        r.input_ids = torch.tensor([rng.randrange(3, 1000) for _ in range(rng.randrange(8, args.max_prompt_len))],
                                   dtype=torch.int32)
        r.max_new_tokens = torch.tensor([[args.max_new_tokens]], dtype=torch.int32)
        r.is_streaming = request_id == 0
        incoming.put(r)

    finished = threading.Event()
    results: dict[int, list[int]] = {}
    first_token_s: dict[int, float] = {}
    num_final = [0]
    iterations: list[dict] = []
    start = time.perf_counter()

    def get_requests(max_num_requests: int) -> list[InferenceRequest]:
        batch = []
        while len(batch) < max_num_requests and not incoming.empty():
            batch.append(incoming.get_nowait())
        return batch

    def send_response(request_id: int, tensors, is_final: bool, err_msg: str) -> None:
        if err_msg:
            print(f"request {request_id} failed: {err_msg}")
        output = {t.name: t.tensor for t in tensors}
        if tensor_names.OUTPUT_IDS in output:
            first_token_s.setdefault(request_id, time.perf_counter() - start)
            results.setdefault(request_id, []).extend(output[tensor_names.OUTPUT_IDS][0, 0].tolist())
        if is_final:
            num_final[0] += 1
        if num_final[0] >= args.requests:
            finished.set()

    def poll_stop_signals() -> set[int]:
        return set()

    def report_stats(stats_json: str) -> None:
        iterations.append(json.loads(stats_json))

    with GptManager(model_dir, TrtGptModelType[args.batching], 1, SchedulerPolicy[args.policy],
                    get_requests, send_response, poll_stop_signals, report_stats,
                    TrtGptModelOptionalParams(), exclude_input_in_output=True):
        finished.wait()
    elapsed = time.perf_counter() - start

    num_tokens = sum(len(tokens) for tokens in results.values())
    print(f"{len(results)} requests, {num_tokens} generated tokens in {elapsed:.2f} s: "
          f"{num_tokens / elapsed:.0f} tokens/s over {len(iterations)} iterations")
    print(f"streamed request 0: first tokens {first_token_s[0] * 1e3:.0f} ms after start (model load included); "
          f"non-streamed requests complete by {max(first_token_s.values()) * 1e3:.0f} ms")
    print("streamed request 0:", results[0][:16], "...")
    print("last stats:", iterations[-1])


if __name__ == "__main__":
    main()
