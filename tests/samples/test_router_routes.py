"""What a router in front of samples.serve asks of it (router_routes; vllm-router's requests as it
sends them): the render and tokenize routes give the token ids the request runs, the load, the
fields the router adds accepted with the values it sends and refused by name otherwise, and the
counters of reused blocks and computed context tokens in /metrics."""
from __future__ import annotations

import json

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.samples.conftest import run
from tests.samples.openai_client import MESSAGES, MODEL, PROMPT, chat_prompt_ids, client, raw_post, start_server
from tests.samples.scripted_model import MAX_SEQ_LEN, REPLY

# The fields vllm-router 0.1.17 adds to what it forwards (and to its render requests), as it sends them.
ROUTER_COMPLETION_FIELDS = {"stream": False, "echo": False, "no_stop_trim": False, "ignore_eos": False,
                            "skip_special_tokens": True, "return_hidden_states": False}
ROUTER_CHAT_FIELDS = {"stream": False, "logprobs": False, "no_stop_trim": False, "ignore_eos": False,
                      "continue_final_message": False, "skip_special_tokens": True, "separate_reasoning": True,
                      "stream_reasoning": True, "return_hidden_states": False, "include_reasoning": True}


@pytest.fixture(scope="module")
def server(scripted):
    s = start_server(scripted, "gpt_manager")
    yield s
    s.stop()


def post_json(server, path: str, body: dict) -> tuple[int, object]:
    status, text = run(raw_post, server.url, path, json.dumps(body).encode())
    return status, json.loads(text)


def test_render_gives_the_prompt_ids_each_request_runs(server, scripted):
    tokenizer = scripted[0]
    status, body = post_json(server, "/v1/completions/render", {"model": MODEL, "prompt": [PROMPT, "Hi"],
                                                                "max_tokens": 4, **ROUTER_COMPLETION_FIELDS})
    assert status == 200 and [r["token_ids"] for r in body] == [tokenizer.encode(PROMPT), tokenizer.encode("Hi")]
    assert all(r["model"] == MODEL and r["request_id"].startswith("cmpl-") for r in body)
    assert body[0]["sampling_params"]["max_tokens"] == 4 and body[0]["sampling_params"]["n"] == 1
    status, body = post_json(server, "/v1/chat/completions/render", {"model": MODEL, "messages": MESSAGES,
                                                                     "max_tokens": 4, **ROUTER_CHAT_FIELDS})
    assert status == 200 and body["token_ids"] == chat_prompt_ids(tokenizer)
    assert body["request_id"].startswith("chatcmpl-")
    status, body = post_json(server, "/v1/completions/render", {"model": "other", "prompt": PROMPT})
    assert status == 404 and body["error"]["param"] == "model"


def test_tokenize_in_vllms_shape(server, scripted):
    tokenizer = scripted[0]
    status, body = post_json(server, "/tokenize", {"prompt": PROMPT})
    assert status == 200 and body == {"count": len(tokenizer.encode(PROMPT)), "max_model_len": MAX_SEQ_LEN,
                                      "tokens": tokenizer.encode(PROMPT), "token_strs": None}
    status, body = post_json(server, "/tokenize", {"model": MODEL, "messages": MESSAGES, "return_token_strs": True})
    assert status == 200 and body["tokens"] == chat_prompt_ids(tokenizer)
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    status, body = post_json(server, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False})
    assert status == 200 and body["tokens"] == tokenizer.encode(PROMPT, add_special_tokens=False)
    for bad, field in (({"prompt": PROMPT, "messages": MESSAGES}, "body"), ({"text": "x"}, "text"),
                       ({"messages": MESSAGES, "add_generation_prompt": False}, "add_generation_prompt")):
        status, body = post_json(server, "/tokenize", bad)
        assert status == 400 and body["error"]["param"] == field


def test_the_fields_the_router_adds_are_accepted_as_it_sends_them(server):
    c = client(server)
    out = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0,
                               extra_body={k: v for k, v in ROUTER_COMPLETION_FIELDS.items() if k != "stream"})
    assert out.choices[0].text.startswith(REPLY)
    out = c.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0,
                                    extra_body={k: v for k, v in ROUTER_CHAT_FIELDS.items() if k != "stream"})
    assert out.choices[0].message.content.startswith(REPLY)
    for path, field, value in (("/v1/completions", "no_stop_trim", True),
                               ("/v1/completions", "skip_special_tokens", False),
                               ("/v1/completions", "return_hidden_states", True),
                               ("/v1/chat/completions", "continue_final_message", True),
                               ("/v1/chat/completions", "separate_reasoning", "yes"),
                               ("/v1/completions", "continue_final_message", False)):   # chat only
        prompt = {"messages": MESSAGES} if "chat" in path else {"prompt": PROMPT}
        status, body = post_json(server, path, {"model": MODEL, **prompt, field: value})
        assert status == 400 and body["error"]["param"] == field, body


def test_get_load_and_the_reuse_counters(server):
    async def get(path: str) -> tuple[int, str]:
        async with aiohttp.ClientSession() as session:
            async with session.get(server.url + path) as response:
                return response.status, await response.text()
    status, text = run(get, "/get_load")
    assert status == 200 and json.loads(text) == {"load": 0, "waiting_handlers": 0}
    client(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
    status, text = run(get, "/metrics")
    samples = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples["nv_trt_llm_kv_cache_reused_blocks_total"] == 0      # this server does not reuse blocks
    assert samples["nv_trt_llm_context_tokens_computed_total"] >= 2


def test_metric_counters_follow_the_stats():
    from samples.serve.metrics import TritonMetrics
    metrics = TritonMetrics(False)
    for reused, context, dropped in ((3, 10, 0), (3, 0, 0), (5, 7, 2)):
        metrics.update(json.dumps({"Reused KV cache blocks": reused, "Total Context Tokens": context,
                                   "KV Events Dropped": dropped}))
    assert metrics.registry.get_sample_value("nv_trt_llm_kv_cache_reused_blocks_total",
                                             metrics.labels) == 5
    assert metrics.registry.get_sample_value("nv_trt_llm_context_tokens_computed_total", metrics.labels) == 17
    assert metrics.registry.get_sample_value("nv_trt_llm_kv_events_dropped_total", metrics.labels) == 2
