"""samples.serve's fleet protocol, over both bridges as `python -m samples.serve` builds them:
/metrics, parsed with prometheus_client's own parser, carries vLLM's names and types (the gateways'
inputs) next to the server's own, with the served model's name as `model_name`; LoRA adapters
loaded and unloaded at run time (vLLM's endpoints), listed in /v1/models, in use while requests
run, and 4xx errors naming the field."""
from __future__ import annotations

import json
import time
import urllib.error
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


@pytest.fixture(scope="module", params=["gpt_manager", "executor"])
def openai_server(tiny_model_dirs, tokenizer_dir, request):
    from samples.serve.launch import load_tokenizer, make_bridge, model_info, parse_args
    engine_dir = tiny_model_dirs[1]
    tokenizer = load_tokenizer(tokenizer_dir)
    args = parse_args(["--engine-dir", engine_dir, "--api", request.param, "--served-model-name", NAME])
    s = ServerThread(engine_dir, tokenizer, bridge=make_bridge(args, engine_dir),
                     model_info=model_info(engine_dir, tokenizer, NAME))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dirs, tmp_path_factory):
    from tests.lora_helpers import ALL_TARGETS, make_peft_adapter
    directory = tmp_path_factory.mktemp("adapter")
    make_peft_adapter(tiny_model_dirs[2], directory, r=4, alpha=8, targets=ALL_TARGETS["llama"], seed=1)
    return str(directory)


def call(url: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def completion(url: str, model: str, max_tokens: int = 6) -> tuple[int, dict]:
    return call(url, "/v1/completions", {"model": model, "prompt": "t5 t9 t17 t33", "max_tokens": max_tokens,
                                         "temperature": 0})


def lora_info(url: str):
    [sample] = scrape(url)["vllm:lora_requests_info"].samples
    return sample.labels


def test_an_adapter_loaded_at_run_time_serves_lists_and_unloads(openai_server, adapter_dir):
    url = openai_server.url
    status, base = completion(url, NAME)
    assert status == 200
    assert call(url, "/v1/load_lora_adapter", {"lora_name": "ad1", "lora_path": adapter_dir}) == \
        (200, {"status": "ok", "lora_name": "ad1"})
    status, models = call(url, "/v1/models")
    assert [(m["id"], m.get("parent"), m.get("root")) for m in models["data"]] == \
        [(NAME, None, None), ("ad1", NAME, adapter_dir)]
    assert call(url, "/v1/models/ad1")[1]["parent"] == NAME
    status, adapted = completion(url, "ad1")
    assert status == 200 and adapted["model"] == "ad1"
    assert adapted["choices"][0]["text"] != base["choices"][0]["text"]   # the adapter changes the greedy tokens
    assert completion(url, "ad1")[1]["choices"][0]["text"] == adapted["choices"][0]["text"]
    assert completion(url, NAME)[1]["choices"][0]["text"] == base["choices"][0]["text"]
    assert lora_info(url)["max_lora"] == "8" and lora_info(url)["running_lora_adapters"] == ""
    assert call(url, "/v1/unload_lora_adapter", {"lora_name": "ad1"}) == (200, {"status": "ok", "lora_name": "ad1"})
    assert [m["id"] for m in call(url, "/v1/models")[1]["data"]] == [NAME]
    status, error = completion(url, "ad1")
    assert status == 404 and error["error"]["param"] == "model"


def test_an_adapter_in_use_is_not_unloaded_and_shows_as_running(openai_server, adapter_dir):
    url = openai_server.url
    assert call(url, "/v1/load_lora_adapter", {"lora_name": "busy", "lora_path": adapter_dir})[0] == 200
    body = json.dumps({"model": "busy", "prompt": "t5 t9", "max_tokens": 60, "temperature": 0, "stream": True,
                       "ignore_eos": True}).encode()
    request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        response.readline()   # the first chunk: the request runs
        assert lora_info(url)["running_lora_adapters"] == "busy"
        status, error = call(url, "/v1/unload_lora_adapter", {"lora_name": "busy"})
        assert status == 409 and error["error"]["param"] == "lora_name" and "running" in error["error"]["message"]
        response.read()
    deadline = time.monotonic() + 30
    while lora_info(url)["running_lora_adapters"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert call(url, "/v1/unload_lora_adapter", {"lora_name": "busy"})[0] == 200


@pytest.mark.parametrize("path, body, status, field", [
    ("/v1/unload_lora_adapter", {"lora_name": "nobody"}, 404, "lora_name"),
    ("/v1/unload_lora_adapter", {}, 404, "lora_name"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nonexistent/adapter"}, 400, "lora_path"),
    ("/v1/load_lora_adapter", {"lora_name": "x"}, 400, "lora_path"),
    ("/v1/load_lora_adapter", {"lora_name": "", "lora_path": "."}, 400, "lora_name"),
    ("/v1/load_lora_adapter", {"lora_name": NAME, "lora_path": "."}, 409, "lora_name"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "BROKEN"}, 400, "lora_path"),
])
def test_unknown_adapter_and_bad_path_are_4xx_naming_the_field(openai_server, tmp_path, path, body, status, field):
    if body.get("lora_path") == "BROKEN":   # the adapter's config is there, its weights are not
        (tmp_path / "adapter_config.json").write_text("{}")
        body = {**body, "lora_path": str(tmp_path)}
    got_status, error = call(openai_server.url, path, body)
    assert got_status == status and error["error"]["param"] == field, error
    assert error["error"]["message"].startswith(field + ":")
