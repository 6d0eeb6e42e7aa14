"""The worker routes a router in front of samples.serve asks for, in vLLM's shapes (what
vllm-router calls; samples.serve.replicas runs it): POST /v1/completions/render and
/v1/chat/completions/render (a request's prompt token ids, exactly as the request would run
them), POST /tokenize, GET /get_load. server.create_app adds them; the router decides, these
only answer."""
from __future__ import annotations

import asyncio
import uuid

from aiohttp import web

from samples.serve.openai_basics import ModelInfo, bad
from samples.serve.openai_protocol import parse_request
from samples.serve.openai_server import CONTEXT, json_response, read_json

LOAD_SOURCE = web.AppKey("load_source", object)   # the bridge (ManagerBridge or ExecutorBridge)


async def handle_completions_render(request: web.Request) -> web.Response:
    """vLLM's shape: one object per prompt: request id, token ids, model, sampling params."""
    info = request.app[CONTEXT].info
    spec = await _parse(await read_json(request), False, info)
    request_id = "cmpl-" + uuid.uuid4().hex
    return json_response([{"request_id": f"{request_id}-{i}", "token_ids": list(prompt), "model": info.name,
                           "sampling_params": _sampling_params(spec, i)} for i, prompt in enumerate(spec.prompts)])


async def handle_chat_render(request: web.Request) -> web.Response:
    info = request.app[CONTEXT].info
    spec = await _parse(await read_json(request), True, info)
    return json_response({"request_id": "chatcmpl-" + uuid.uuid4().hex, "token_ids": list(spec.prompts[0]),
                          "model": info.name, "sampling_params": _sampling_params(spec, 0)})


async def handle_tokenize(request: web.Request) -> web.Response:
    """{"prompt": text, "add_special_tokens": true} or {"messages": [...], "add_generation_prompt":
    true} -> {"count", "max_model_len", "tokens", "token_strs"} (token_strs with return_token_strs)."""
    info = request.app[CONTEXT].info
    body = await read_json(request)
    ids = await asyncio.get_running_loop().run_in_executor(None, _tokenize, body, info)
    strs = info.tokenizer.convert_ids_to_tokens(ids) if body.get("return_token_strs") is True else None
    return json_response({"count": len(ids), "max_model_len": info.max_seq_len, "tokens": ids, "token_strs": strs})


async def handle_load(request: web.Request) -> web.Response:
    """{"load": the engine's requests, admitted or waiting} (vllm-router's power_of_two polls it)."""
    bridge = request.app[LOAD_SOURCE]
    return json_response({"load": bridge.num_active_requests(), "waiting_handlers": bridge.num_waiting_handlers()})


async def _parse(body, is_chat: bool, info: ModelInfo):
    # NOTE: off the loop: it tokenizes (see openai_server)
    return await asyncio.get_running_loop().run_in_executor(None, parse_request, body, is_chat, info)


def _sampling_params(spec, prompt_index: int) -> dict:
    fields = {name: spec.engine_fields[name] for name in ("temperature", "top_p", "top_k") if name in spec.engine_fields}
    return {"n": spec.n, "max_tokens": spec.max_tokens[prompt_index], "stop": list(spec.stop), "seed": spec.seed,
            **fields}


def _tokenize(body, info: ModelInfo) -> list[int]:
    if not isinstance(body, dict):
        raise bad("body", f"expected a JSON object, got {type(body).__name__}")
    known = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt", "return_token_strs"}
    unknown = set(body) - known
    if unknown:
        raise bad(min(unknown), f"unknown field; accepted: {sorted(known)}")
    if ("prompt" in body) == ("messages" in body):
        raise bad("body", "expected exactly one of prompt and messages")
    request = {"model": body.get("model", info.name)}
    if "messages" in body:   # rendered as /v1/chat/completions renders them
        if body.get("add_generation_prompt", True) is not True:
            raise bad("add_generation_prompt", "only true is supported (the chat endpoint always adds it)")
        return list(parse_request({**request, "messages": body["messages"], "max_tokens": 1}, True, info).prompts[0])
    prompt = body["prompt"]
    if body.get("add_special_tokens", True) is True or not isinstance(prompt, str):
        return list(parse_request({**request, "prompt": prompt, "max_tokens": 1}, False, info).prompts[0])
    parse_request({**request, "prompt": prompt, "max_tokens": 1}, False, info)   # the checks (model, length)
    return list(info.tokenizer.encode(prompt, add_special_tokens=False))


def add_routes(app: web.Application, bridge) -> None:
    """GET /get_load; with the OpenAI routes (a tokenizer), the render and tokenize routes too."""
    app[LOAD_SOURCE] = bridge
    app.add_routes([web.get("/get_load", handle_load)])
    if CONTEXT in app:
        app.add_routes([web.post("/v1/completions/render", handle_completions_render),
                        web.post("/v1/chat/completions/render", handle_chat_render),
                        web.post("/tokenize", handle_tokenize)])
