"""samples.triton's `tensorrt_llm` model through a real Triton server and `tritonclient` gRPC
streaming, on a tiny random-weight engine: greedy tokens against the GptManager run directly,
concurrent streams, stop and client cancellation, bad requests, and the metric families."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from runtime import build_engine
from samples.chaos_soak.tracker import threads_started_since
from tests.factories import make_checkpoint
from tests.samples.triton_support import metric_values, module_server, skip_without_triton

MAX_SEQ_LEN = 1024
LONG = 900   # tokens a stopped request asked for: it would run ~900 iterations
PROMPTS = [[3 + (7 * i + 5 * j) % 120 for j in range(4 + 3 * i)] for i in range(8)]


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    skip_without_triton()
    root = tmp_path_factory.mktemp("triton-engine")
    make_checkpoint(root / "hf", "llama", max_position_embeddings=MAX_SEQ_LEN)
    build_engine(root / "hf", root / "engine", tokens_per_block=4, max_batch_size=16, max_input_len=64,
                 max_seq_len=MAX_SEQ_LEN, max_num_tokens=512)
    return str(root / "engine")


@pytest.fixture(scope="module")
def server(tmp_path_factory, engine_dir):
    from samples.triton.repository import RepositoryOptions
    with module_server(tmp_path_factory, engine_dir, RepositoryOptions(cancellation_check_period_ms=20)) as s:
        yield s


@pytest.fixture(scope="module")
def direct(engine_dir):
    from samples.triton.bench import DirectRun
    run = DirectRun(engine_dir)
    yield run
    run.close()


@pytest.fixture
def client(server):
    from samples.triton.client import StreamClient
    stream = StreamClient(server.grpc_url)
    yield stream
    stream.close()


def llm_inputs(*args, **kwargs):
    from samples.triton.client import llm_inputs
    return llm_inputs(*args, **kwargs)


def wait_for_tokens(client, request_id: str, num_tokens: int, timeout_s: float = 30.0) -> None:
    deadline_s = time.monotonic() + timeout_s
    while len(client.result(request_id).tokens) < num_tokens:
        assert time.monotonic() < deadline_s, f"request {request_id}: fewer than {num_tokens} tokens"
        time.sleep(0.005)


def wait_idle(server, timeout_s: float = 30.0) -> dict[str, float]:
    """The KV-cache gauges once no request is active (the metrics follow the worker's next iteration)."""
    deadline_s = time.monotonic() + timeout_s
    while True:
        requests = metric_values(server, "nv_trt_llm_request_metrics")
        kv = metric_values(server, "nv_trt_llm_kv_cache_block_metrics")
        if requests["active"] == 0 and kv["used"] == 0:
            return kv
        assert time.monotonic() < deadline_s, f"still active: {requests}, {kv}"
        time.sleep(0.05)


def test_greedy_tokens_equal_the_gpt_manager_run_directly(server, direct, client):
    expected, _, _ = direct.run(PROMPTS[:2], [12, 12])
    for streaming in (False, True):
        for i, prompt in enumerate(PROMPTS[:2]):
            client.submit(f"{i + 10 * streaming}", llm_inputs(prompt, 12, streaming))
        for i in range(2):
            result = client.wait(f"{i + 10 * streaming}")
            assert result.error is None
            assert result.tokens == expected[i]
            assert len(result.arrival_s) == (12 if streaming else 1)   # streaming: each step's new token


def test_eight_concurrent_streams_each_equal_their_own_run(server, direct):
    from samples.triton.client import StreamClient
    lengths = [8 + 3 * i for i in range(8)]
    expected = [direct.run([prompt], [n])[0][0] for prompt, n in zip(PROMPTS, lengths)]
    streams = [StreamClient(server.grpc_url) for _ in range(8)]
    try:
        for i, stream in enumerate(streams):
            stream.submit(str(100 + i), llm_inputs(PROMPTS[i], lengths[i], True))
        results = [stream.wait(str(100 + i)) for i, stream in enumerate(streams)]
    finally:
        for stream in streams:
            stream.close()
    assert [r.tokens for r in results] == expected


def test_stop_input_ends_the_live_request_with_that_id(server, client):
    client.submit("200", llm_inputs(PROMPTS[0], LONG, True))
    wait_for_tokens(client, "200", 3)
    client.send_stop("200")
    result = client.wait("200")
    assert result.error is None
    assert 3 <= len(result.tokens) < LONG / 2
    client.submit("201", llm_inputs(PROMPTS[1], 5, False))   # the model serves the next one
    assert len(client.wait("201").tokens) == 5
    kv = wait_idle(server)
    assert kv["free"] == kv["max"]                            # the stopped request's blocks are free


def test_client_cancellation_ends_the_request(server):
    from samples.triton.client import StreamClient
    threads = set(threading.enumerate())
    stream = StreamClient(server.grpc_url)
    stream.submit("300", llm_inputs(PROMPTS[2], LONG, True))
    wait_for_tokens(stream, "300", 3)
    iterations_at_cancel = metric_values(server, "nv_trt_llm_general_metrics")["iteration_counter"]
    stream.close(cancel_requests=True)
    # No thread outlives the stream: gRPC's request feeder waited for ever after a cancel.
    assert threads_started_since(threads, grace_s=10.0) == []
    wait_idle(server)
    iterations_after = metric_values(server, "nv_trt_llm_general_metrics")["iteration_counter"]
    assert iterations_after - iterations_at_cancel < LONG / 2   # ended long before its 900 tokens
    follow_up = StreamClient(server.grpc_url)
    try:
        follow_up.submit("300", llm_inputs(PROMPTS[2], 4, False))   # the id is free again
        assert len(follow_up.wait("300").tokens) == 4
    finally:
        follow_up.close()


def test_bad_requests_get_an_error_naming_the_tensor_and_the_model_keeps_serving(server, client):
    from samples.triton.client import input_tensor
    good = llm_inputs(PROMPTS[0], 4, False)
    cases = {
        "400": ([t for t in good if t.name() != "input_ids"], "input_ids"),
        "401": (llm_inputs(PROMPTS[0], 0, False), "request_output_len"),
        "402": ([input_tensor("input_ids", np.array([PROMPTS[0]], np.float32))] + good[1:], "input_ids"),
        "403": (llm_inputs(PROMPTS[0], 4, False, end_id=np.array([[1, 2]], np.int32)), "end_id"),
    }
    for request_id, (inputs, _) in cases.items():
        client.submit(request_id, inputs)
    for request_id, (_, tensor) in cases.items():
        result = client.wait(request_id)
        assert result.error is not None and tensor in result.error, (request_id, result.error)
    client.submit("404", llm_inputs(PROMPTS[0], LONG, True))
    wait_for_tokens(client, "404", 1)
    duplicate = client.result("404")
    client.submit("404", llm_inputs(PROMPTS[0], 4, False))      # the same id while the first lives
    assert "already in use" in client.wait("404").error
    client.send_stop("404")
    client.submit("405", good)
    assert client.wait("405").error is None and len(client.result("405").tokens) == 4
    assert duplicate.error is None
    wait_idle(server)


def test_metric_families_carry_the_stats_json(server, direct, client):
    import orjson
    direct.run([PROMPTS[0]], [2])
    stats = orjson.loads(direct.stats_json[-1])
    client.submit("500", llm_inputs(PROMPTS[0], 6, False))
    client.wait("500")
    kv = wait_idle(server)
    assert kv == {"max": stats["Max KV cache blocks"], "free": stats["Max KV cache blocks"], "used": 0,
                  "tokens_per": stats["Tokens per KV cache block"]}
    requests = metric_values(server, "nv_trt_llm_request_metrics")
    assert requests == {"active": 0, "max": stats["Max Request Count"], "scheduled": 0, "context": 0}
    assert set(metric_values(server, "nv_trt_llm_runtime_memory_metrics")) == {"cpu", "gpu", "pinned"}
    assert metric_values(server, "nv_trt_llm_runtime_memory_metrics")["cpu"] > 0
    assert metric_values(server, "nv_trt_llm_inflight_batcher_metrics") == {
        "total_context_tokens": 0, "generation_requests": 0, "micro_batch_id": stats["MicroBatch ID"],
        "paused_requests": 0}
    general = metric_values(server, "nv_trt_llm_general_metrics")
    # Six tokens: the legacy manager reports the iterations that leave a request active, five
    # (more when earlier tests ran on this module's server).
    assert general["iteration_counter"] >= 5
    assert abs(general["timestamp"] - time.time()) < 600


def test_the_command_serves_until_sigint_then_ends_live_requests_and_exits_cleanly(engine_dir, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    from samples.triton.client import StreamClient
    from samples.triton.testing import free_ports
    http_port, grpc_port, metrics_port = free_ports(3)
    process = subprocess.Popen(
        [sys.executable, "-m", "samples.triton", "--engine-dir", engine_dir, "--model-repository", str(tmp_path),
         "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port)],
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    watchdog = threading.Timer(300, process.kill)   # a server that never says it serves fails, never hangs the run
    watchdog.start()
    try:
        lines = []
        for line in process.stdout:
            lines.append(line)
            if line.startswith("serving:"):
                break
        watchdog.cancel()
        assert f"127.0.0.1:{grpc_port}" in lines[-1], lines
        assert sorted(os.listdir(tmp_path)) == ["tensorrt_llm"]   # no tokenizer: no text models
        stream = StreamClient(f"127.0.0.1:{grpc_port}")
        stream.submit("1", llm_inputs(PROMPTS[0], LONG, True))
        wait_for_tokens(stream, "1", 2)
        process.send_signal(signal.SIGINT)
        result = stream.wait("1", 30)                 # the live request ends with a final response
        assert result.error is None and len(result.tokens) < LONG
        stream.close()   # NOTE: Triton keeps its models loaded for a stream still open, up to its exit timeout
        assert process.wait(60) == 0
    finally:
        watchdog.cancel()
        if process.poll() is None:
            process.kill()
            process.wait()
