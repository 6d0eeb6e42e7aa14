"""An asyncio HTTP server (aiohttp) that embeds a GptManager: what the batch manager is for.

    python -m samples.serve [--engine-dir DIR] [--tokenizer DIR] [--host 127.0.0.1] [--port 8000]
                            [--api gpt_manager|executor]

POST /generate  {"input_ids": [...] | "text": "...", "max_new_tokens": 64, "stream": false, sampling...}
                -> JSON, or server-sent events when "stream" is true; a bad body: 400
                   {"error": "<field or body>: <problem>"}, with nothing queued
GET  /metrics   Prometheus gauges (the legacy Triton TensorRT-LLM backend's nv_trt_llm_* families)
GET  /health    {"status": "ok", "active_requests": N}

Handlers queue requests for the manager's get-requests callback (or, with --api executor, enqueue
them into an Executor) and await their responses; a client that disconnects stops its request. The default model (random weights) is written on
first run; its output tokens are meaningless.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from batch_manager import SchedulerPolicy, TrtGptModelType
from samples.benchmark.ours import MODEL_TYPES, optional_params
from samples.serve.bridge import ManagerBridge, ResponseEvent
from samples.serve.metrics import TritonMetrics
from samples.serve.params import GenerateParams, name_body_field, parse_generate_body

logger = logging.getLogger(__name__)

BRIDGE = web.AppKey("bridge", object)   # ManagerBridge or executor_bridge.ExecutorBridge
SETTINGS = web.AppKey("settings", dict)


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def _event_body(request_id: int, event: ResponseEvent, tokenizer, all_ids: list[int], previous_text: str) -> dict:
    body = {"request_id": request_id, "output_ids": event.output_ids, "is_final": event.is_final}
    if tokenizer is not None:
        body["text"] = tokenizer.decode(all_ids, skip_special_tokens=True)[len(previous_text):]
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
    try:
        params = parse_generate_body(body, tokenizer, settings["default_max_new_tokens"])
    except ValueError as e:
        return _error(400, str(e))
    except RecursionError:   # repr of a deeply nested value in an error message
        return _error(400, "body: a field's value is nested too deeply")
    try:
        request_id, events = bridge.submit(params.to_request, params.return_log_probs, asyncio.get_running_loop())
    except ValueError as e:   # the Executor validates at enqueue
        return _error(400, str(e))
    except RuntimeError as e:
        return _error(503, str(e))
    try:
        first = await events.get()
        if first.error:
            if first.is_bad_request:
                return _error(400, name_body_field(first.error))
            return _error(500, first.error)
        if not params.is_streaming:
            result = _event_body(request_id, first, tokenizer, first.output_ids, "")
            result["num_output_tokens"] = len(first.output_ids)
            return web.json_response(result)
        return await _stream(request, request_id, params, first, events, tokenizer)
    finally:  # normal end: a no-op; disconnect (cancellation, reset): the request is stopped
        bridge.cancel(request_id)


async def _stream(request: web.Request, request_id: int, params: GenerateParams, event: ResponseEvent,
                  events: asyncio.Queue, tokenizer) -> web.StreamResponse:
    """Server-sent events: one `data: {...}` per response, the last with "is_final": true."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    all_ids: list[int] = []
    text = ""
    while True:
        if event.error:
            await response.write(f"event: error\ndata: {json.dumps({'error': event.error})}\n\n".encode())
            break
        all_ids.extend(event.output_ids)
        body = _event_body(request_id, event, tokenizer, all_ids, text)
        text += body.get("text", "")
        await response.write(f"data: {json.dumps(body)}\n\n".encode())
        if event.is_final:
            break
        event = await events.get()
    await response.write_eof()
    return response


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
    if bridge.num_active_requests() == 0:
        bridge.metrics.mark_idle()
    return web.Response(body=generate_latest(bridge.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


def create_app(bridge: ManagerBridge, tokenizer=None, default_max_new_tokens: int = 64) -> web.Application:
    app = web.Application()
    app[BRIDGE] = bridge
    app[SETTINGS] = {"tokenizer": tokenizer, "default_max_new_tokens": default_max_new_tokens}
    app.add_routes([web.post("/generate", handle_generate), web.get("/health", handle_health),
                    web.get("/metrics", handle_metrics)])
    return app


async def start_server(bridge: ManagerBridge, host: str, port: int, tokenizer=None,
                       default_max_new_tokens: int = 64) -> tuple[web.AppRunner, int]:
    """Serve on host:port (0: a free port); returns (runner, the bound port). handler_cancellation
    makes a client disconnect cancel its handler, which stops the request."""
    runner = web.AppRunner(create_app(bridge, tokenizer, default_max_new_tokens), handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, runner.addresses[0][1]


def make_bridge(args):
    from samples.default_model import default_model_dir
    model_type = MODEL_TYPES[args.type]
    metrics = TritonMetrics(model_type == TrtGptModelType.V1, model=args.model_name)
    if args.api == "executor":
        from samples.benchmark.executor import executor_config
        from samples.serve.executor_bridge import ExecutorBridge
        config = executor_config(args)
        config.max_beam_width = args.max_beam_width
        return ExecutorBridge(args.engine_dir or default_model_dir(), config, metrics)
    return ManagerBridge(args.engine_dir or default_model_dir(), model_type, args.max_beam_width,
                         SchedulerPolicy[args.scheduler_policy.upper()], optional_params(args), metrics)


def load_tokenizer(directory: str | None):
    if directory is None:
        return None
    import transformers
    return transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine-dir", help="engine or HF checkpoint directory (default: the random default model)")
    p.add_argument("--tokenizer", help="a local tokenizer directory: enables \"text\" in requests and responses")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (printed)")
    p.add_argument("--api", default="gpt_manager", choices=["gpt_manager", "executor"],
                   help="the front-end the handlers use: GptManager's callbacks or the Executor's queues")
    p.add_argument("--type", default="IFB", choices=sorted(MODEL_TYPES))
    p.add_argument("--scheduler-policy", default="guaranteed_no_evict",
                   choices=["guaranteed_no_evict", "max_utilization", "static_batch"])
    p.add_argument("--max-beam-width", type=int, default=1)
    p.add_argument("--max-batch-size", type=int)
    p.add_argument("--max-num-tokens", type=int)
    p.add_argument("--max-tokens-in-paged-kvcache", type=int)
    p.add_argument("--kv-cache-free-gpu-mem-fraction", type=float)
    p.add_argument("--default-max-new-tokens", type=int, default=64)
    p.add_argument("--model-name", default="tensorrt_llm", help="the `model` label of the metrics")
    return p.parse_args(argv)


async def _serve(args) -> None:
    tokenizer = load_tokenizer(args.tokenizer)
    bridge = make_bridge(args)
    runner, port = await start_server(bridge, args.host, args.port, tokenizer, args.default_max_new_tokens)
    print(f"listening on http://{args.host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        bridge.close()
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_serve(parse_args(argv)))


if __name__ == "__main__":
    main()
