"""The cost of the Triton server: the W64 workload (64 requests, prompts uniform 16-256 tokens,
outputs uniform 16-128, random ids, no end id) through a GptManager directly, then through Triton's
`tensorrt_llm` model over gRPC streaming (same engine, same KV pool, same sitting, alternating
rounds), and the time to first token of one streamed request through each (median of a few tries).

    python -m samples.triton.bench [--engine-dir DIR] [--num-requests 64] [--rounds 2] [--ttft-tries 5]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time

import torch

from batch_manager import (GptManager, InferenceRequest, KvCacheConfig, SchedulerPolicy, TrtGptModelOptionalParams,
                           TrtGptModelType, tensor_names)
from runtime.engine import ENGINE_CONFIG_FILE
from samples.benchmark.dataset import LengthDistribution, Sample, synthetic_dataset
from samples.default_model import model_from_arguments

W64 = dict(prompt_len="uniform:16:256", output_len="uniform:16:128")   # the prompts' bound: the engine's, if lower


def w64_samples(engine_dir: str, num_requests: int, seed: int = 0) -> list[Sample]:
    """W64 within the engine's limits (an engine directory's engine.json)."""
    with open(os.path.join(engine_dir, ENGINE_CONFIG_FILE)) as f:
        engine = json.load(f)
    max_prompt_len = min(256, engine["build"]["max_input_len"])
    return synthetic_dataset(num_requests, LengthDistribution.parse("prompt", f"uniform:16:{max_prompt_len}"),
                             LengthDistribution.parse("output", W64["output_len"]), engine["model"]["vocab_size"],
                             seed, min(engine["build"]["max_seq_len"], 384))


class DirectRun:
    """A GptManager on `engine_dir` with the four callbacks over a list of samples."""

    def __init__(self, engine_dir: str, options: TrtGptModelOptionalParams | None = None):
        self._lock = threading.Lock()
        self._incoming: list[InferenceRequest] = []
        self._tokens: dict[int, list[int]] = {}
        self._first_s: dict[int, float] = {}
        self._num_pending = 0
        self._done = threading.Event()
        self.stats_json: list[str] = []
        self.manager = GptManager(engine_dir, TrtGptModelType.InflightFusedBatching, 1,
                                  SchedulerPolicy.GUARANTEED_NO_EVICT, self._get, self._send, lambda: set(),
                                  self.stats_json.append, options or TrtGptModelOptionalParams(),
                                  exclude_input_in_output=True)

    def _get(self, max_num_requests: int) -> list[InferenceRequest]:
        with self._lock:
            taken, self._incoming = self._incoming[:max_num_requests], self._incoming[max_num_requests:]
        return taken

    def _send(self, request_id: int, tensors, is_final: bool, err_msg: str) -> None:
        assert not err_msg, err_msg
        output = {t.name: t.tensor for t in tensors}
        if tensor_names.OUTPUT_IDS in output:
            self._first_s.setdefault(request_id, time.perf_counter())
            self._tokens[request_id].extend(output[tensor_names.OUTPUT_IDS][0, 0].tolist())
        if is_final:
            with self._lock:
                self._num_pending -= 1
                if self._num_pending == 0:
                    self._done.set()

    def run(self, prompts: list[list[int]], max_new_tokens: list[int], streaming: bool = False,
            end_id: int | None = None) -> tuple[list[list[int]], float, list[float]]:
        """(tokens per request, seconds for all, seconds to each request's first response)."""
        requests = []
        for request_id, (prompt, num_new) in enumerate(zip(prompts, max_new_tokens)):
            r = InferenceRequest(request_id)
            r.input_ids = torch.tensor(prompt, dtype=torch.int32)
            r.max_new_tokens = torch.tensor([[num_new]], dtype=torch.int32)
            if end_id is not None:
                r.end_id = torch.tensor([end_id], dtype=torch.int32)
            r.is_streaming = streaming
            requests.append(r)
        self._tokens = {i: [] for i in range(len(requests))}
        self._first_s.clear()
        self._done.clear()
        self._num_pending = len(requests)
        start_s = time.perf_counter()
        with self._lock:
            self._incoming.extend(requests)
        self._done.wait()
        elapsed_s = time.perf_counter() - start_s
        return ([self._tokens[i] for i in range(len(requests))], elapsed_s,
                [self._first_s[i] - start_s for i in range(len(requests))])

    def close(self) -> None:
        self.manager.shutdown()


def triton_run(url: str, prompts: list[list[int]], max_new_tokens: list[int], streaming: bool = False,
               end_id: int | None = None) -> tuple[list[list[int]], float, list[float]]:
    """The same through Triton's `tensorrt_llm` model on one gRPC stream."""
    from samples.triton.client import StreamClient, llm_inputs
    client = StreamClient(url)
    try:
        start_s = time.perf_counter()
        for i, (prompt, num_new) in enumerate(zip(prompts, max_new_tokens)):
            client.submit(str(i), llm_inputs(prompt, num_new, streaming, end_id))
        results = [client.wait(str(i), timeout_s=3600) for i in range(len(prompts))]
        elapsed_s = time.perf_counter() - start_s
    finally:
        client.close()
    for i, result in enumerate(results):
        assert result.error is None, f"request {i}: {result.error}"
    return [r.tokens for r in results], elapsed_s, [r.arrival_s[0] - start_s for r in results]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine-dir")
    p.add_argument("--random-model", action="store_true")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="W64 directly then through Triton, this many times")
    p.add_argument("--ttft-tries", type=int, default=5)
    p.add_argument("--kv-tokens", type=int, default=64 * 384, help="the KV pool of each GptManager (tokens)")
    args = p.parse_args()
    from samples.triton.repository import RepositoryOptions
    from samples.triton.testing import running_server
    engine_dir = model_from_arguments(args.engine_dir, args.random_model)
    samples = w64_samples(engine_dir, args.num_requests)
    prompts, lengths = [s.input_ids for s in samples], [s.output_len for s in samples]
    num_tokens = sum(lengths)
    short = ([prompts[0][:32]], [16])
    print(f"W{len(samples)} ({num_tokens} generated tokens), engine {engine_dir}", flush=True)

    # NOTE: both stay up and the runs alternate, so that the pairs share the machine's moment: on a
    # shared CPU the load of others moves a run's throughput more than the server does.
    direct = DirectRun(engine_dir, TrtGptModelOptionalParams(kv_cache_config=KvCacheConfig(max_tokens=args.kv_tokens)))
    options = RepositoryOptions(max_tokens_in_paged_kv_cache=args.kv_tokens)
    with tempfile.TemporaryDirectory() as repository, running_server(repository, engine_dir, options) as server:
        direct.run(*short)                    # warm-ups
        triton_run(server.grpc_url, *short)
        for round_index in range(args.rounds):
            _, direct_s, _ = direct.run(prompts, lengths)
            _, triton_s, _ = triton_run(server.grpc_url, prompts, lengths)
            print(f"round {round_index + 1}: GptManager directly {num_tokens / direct_s:6.1f} tokens/s "
                  f"({direct_s:.1f} s), through Triton {num_tokens / triton_s:6.1f} tokens/s ({triton_s:.1f} s): "
                  f"{triton_s / direct_s - 1:+.1%} time", flush=True)
        direct_ttft_s, triton_ttft_s = [], []
        for _ in range(args.ttft_tries):
            direct_ttft_s.append(direct.run(*short, streaming=True)[2][0])
            triton_ttft_s.append(triton_run(server.grpc_url, *short, streaming=True)[2][0])
    direct.close()
    print(f"TTFT p50, one streamed request (32-token prompt), {args.ttft_tries} tries each, alternating: "
          f"directly {statistics.median(direct_ttft_s) * 1e3:.1f} ms, "
          f"through Triton {statistics.median(triton_ttft_s) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
