"""Quick start for the Executor: enqueue requests, await their responses, on the default model.

The default model (a random-weight ~57M LLaMA-style checkpoint) is written on first run; pass
--model to use any HF checkpoint or engine directory instead. At the end, one streaming request
goes into the idle executor and its time to first token is printed.

    python -m samples.executor_quickstart [--model DIR] [--requests 8] [--max-tokens 32]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from batch_manager.executor import Executor, ExecutorConfig, ModelType, OutputConfig, Request, SamplingConfig
from samples.default_model import default_model_dir


def idle_ttft_s(executor: Executor, prompt: list[int]) -> float:
    """Seconds from enqueue_request to the first streamed token, the executor being idle."""
    start = time.perf_counter()
    request_id = executor.enqueue_request(Request(prompt, 2, streaming=True))
    first = executor.await_responses(request_id)
    elapsed_s = time.perf_counter() - start
    while not first[-1].result.is_final:
        first = executor.await_responses(request_id)
    return elapsed_s


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF checkpoint or engine directory (default: the random LLaMA-style model)")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--ttft-repeats", type=int, default=5)
    args = p.parse_args(argv)
    model_dir = args.model or default_model_dir()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 100) for _ in range(rng.randrange(4, 24))] for _ in range(args.requests)]

    with Executor(model_dir, ModelType.DECODER_ONLY, ExecutorConfig(max_beam_width=2)) as executor:
        ids = executor.enqueue_requests([
            Request(prompt, args.max_tokens, streaming=i == 0, output_config=OutputConfig(exclude_input_from_output=True),
                    sampling_config=SamplingConfig(beam_width=2 if i == 1 else 1))
            for i, prompt in enumerate(prompts)])
        tokens: dict[int, list[int]] = {i: [] for i in ids}
        pending = set(ids)
        while pending:                                  # the loop of the bindings' examples
            for response in executor.await_responses(timeout=1.0):
                if response.has_error():
                    raise RuntimeError(f"request {response.request_id}: {response.error_msg}")
                result = response.result
                tokens[response.request_id] += result.output_token_ids[0]   # beam 0
                if result.is_final:
                    pending.discard(response.request_id)
                    print(f"request {response.request_id}: {len(tokens[response.request_id])} tokens, "
                          f"{result.finish_reasons[0].name}")
        ttft_s = [idle_ttft_s(executor, prompts[0]) for _ in range(args.ttft_repeats)]
        print(f"time to first token into an idle executor: median {statistics.median(ttft_s) * 1e3:.1f} ms "
              f"(min {min(ttft_s) * 1e3:.1f} ms, {len(ttft_s)} runs, prompt of {len(prompts[0])} tokens)")
    return {"tokens": tokens, "idle_ttft_s": ttft_s}


if __name__ == "__main__":
    main()
