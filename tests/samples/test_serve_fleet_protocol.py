"""samples.serve's fleet protocol: /metrics, parsed with prometheus_client's own parser, carries
vLLM's names and types (the gateways' inputs) next to the server's own, with the served model's
name as `model_name`, over both bridges as `python -m samples.serve` builds them."""
from __future__ import annotations

import json
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.samples.conftest import ServerThread

NAME = "tiny-served"
PROMPT = [5, 9, 17, 33, 4, 70, 12, 8, 90, 3, 44, 51, 6]   # three full blocks of 4 tokens
VLLM_TYPES = {"vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
              "vllm:kv_cache_usage_perc": "gauge", "vllm:lora_requests_info": "gauge",
              "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
              "vllm:time_to_first_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
              "vllm:e2e_request_latency_seconds": "histogram", "vllm:prompt_tokens": "counter",
              "vllm:generation_tokens": "counter"}


@pytest.fixture(scope="module", params=["gpt_manager", "executor"])
def server(tiny_model_dirs, request):
    from samples.serve.launch import make_bridge, parse_args
    engine_dir = tiny_model_dirs[1]
    args = parse_args(["--engine-dir", engine_dir, "--api", request.param, "--enable-block-reuse",
                       "--served-model-name", NAME])
    s = ServerThread(engine_dir, bridge=make_bridge(args, engine_dir))
    yield s
    s.stop()


def stream(url: str, body: dict) -> list[dict]:
    request = urllib.request.Request(url + "/generate", json.dumps({**body, "stream": True}).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return [json.loads(line[6:]) for line in response.read().decode().splitlines() if line.startswith("data: ")]


def scrape(url: str) -> dict:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        return {family.name: family for family in text_string_to_metric_families(response.read().decode())}


def value(family, suffix: str = "") -> float:
    return sum(s.value for s in family.samples if s.name == family.name + suffix)


def test_vllm_names_and_types_next_to_ours(server):
    before = scrape(server.url)
    for _ in range(2):   # the repeat finds the first one's prompt blocks in the prefix cache
        events = stream(server.url, {"input_ids": PROMPT, "max_new_tokens": 5})
        assert sum(len(e["output_ids"]) for e in events) == 5
    families = scrape(server.url)
    assert {name: families[name].type for name in VLLM_TYPES} == VLLM_TYPES
    assert "nv_trt_llm_request_metrics" in families   # ours stay
    for name in VLLM_TYPES:
        assert all(s.labels.get("model_name") == NAME for s in families[name].samples), name

    def grew(name: str, suffix: str = "") -> float:
        return value(families[name], suffix) - value(before[name], suffix)

    assert grew("vllm:time_to_first_token_seconds", "_count") == 2
    assert grew("vllm:e2e_request_latency_seconds", "_count") == 2
    assert grew("vllm:inter_token_latency_seconds", "_count") == 8
    assert grew("vllm:prompt_tokens", "_total") == 2 * len(PROMPT)
    assert grew("vllm:generation_tokens", "_total") == 10
    assert grew("vllm:prefix_cache_hits", "_total") >= 8   # at least two of the repeat's three blocks
    assert grew("vllm:prefix_cache_queries", "_total") >= grew("vllm:prefix_cache_hits", "_total")
    assert value(families["vllm:num_requests_running"]) == 0 and value(families["vllm:num_requests_waiting"]) == 0
    assert value(families["vllm:kv_cache_usage_perc"]) == 0.0   # idle: every block free or cached
    [info] = families["vllm:lora_requests_info"].samples
    assert set(info.labels) == {"model_name", "max_lora", "running_lora_adapters", "waiting_lora_adapters"}
    assert info.labels["running_lora_adapters"] == "" and info.value > 1.6e9
