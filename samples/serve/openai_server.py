"""The OpenAI-compatible endpoints of samples.serve: GET /v1/models, GET /v1/models/{model},
POST /v1/completions and POST /v1/chat/completions (JSON, or server-sent events in OpenAI's chunk
format ending with `data: [DONE]`; chat's tool calls as `message.tool_calls`, streamed as
`delta.tool_calls`), errors in OpenAI's shape (a 429 with Retry-After). Handlers parse the body
(`openai_protocol`, on a worker thread: it tokenizes), run the choices (`openai_choices`) and
shape what comes back."""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

import orjson
from aiohttp import web

from samples.serve.openai_choices import ChoiceRun, ChoiceUpdate, TokenLogProb
from samples.serve.lora_routes import ADAPTERS, DEFAULT_MAX_LORAS, LoraAdapters, add_routes as add_lora_routes
from samples.serve.openai_basics import ModelInfo, OpenAIError, bad
from samples.serve.openai_protocol import parse_request

OWNED_BY = "batch_manager"


@dataclass(frozen=True)
class OpenAIContext:
    info: ModelInfo
    bridge: object          # bridge.ManagerBridge or executor_bridge.ExecutorBridge
    created_s: int          # when the routes were added: the model card's `created`


CONTEXT = web.AppKey("openai", OpenAIContext)


def json_response(body: dict, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def error_response(error: OpenAIError) -> web.Response:
    response = json_response(error.body(), error.status)
    response.headers.update(error.headers)
    return response


async def read_json(request: web.Request):
    """The body as JSON. 413 past the server's client_max_size (aiohttp refuses the read)."""
    try:
        data = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise OpenAIError(413, f"body: larger than this server's limit of {request.client_max_size} bytes",
                          "body", "request_too_large") from None
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as e:   # also invalid UTF-8 and nesting over orjson's limit
        raise bad("body", f"not valid JSON ({e})") from None


def _model_card(info: ModelInfo, created: int, adapter=None) -> dict:
    """The base model's card, or (vLLM's shape) a loaded LoRA adapter's: its root, its parent."""
    if adapter is not None:
        return {"id": adapter.name, "object": "model", "created": created, "owned_by": OWNED_BY,
                "root": adapter.path, "parent": info.name, "max_model_len": info.max_seq_len}
    return {"id": info.name, "object": "model", "created": created, "owned_by": OWNED_BY,
            "max_model_len": info.max_seq_len}


async def handle_models(request: web.Request) -> web.Response:
    context, adapters = request.app[CONTEXT], request.app[ADAPTERS]
    cards = [_model_card(context.info, context.created_s)] + [
        _model_card(context.info, context.created_s, adapters.get(name)) for name in adapters.names()]
    return json_response({"object": "list", "data": cards})


async def handle_model(request: web.Request) -> web.Response:
    context, model = request.app[CONTEXT], request.match_info["model"]
    adapter = request.app[ADAPTERS].get(model)
    if model != context.info.name and adapter is None:
        raise OpenAIError(404, f"model: {model!r:.80} is not served here; this server serves "
                               f"{context.info.name!r}", "model", "model_not_found")
    return json_response(_model_card(context.info, context.created_s, adapter))


async def handle_completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, is_chat=False)


async def handle_chat_completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, is_chat=True)


async def _complete(request: web.Request, is_chat: bool) -> web.StreamResponse:
    context, adapters = request.app[CONTEXT], request.app[ADAPTERS]
    info, bridge = context.info, context.bridge
    body = await read_json(request)
    # NOTE: off the loop, so tokenizing (bounded by info.max_text_chars) never stalls other clients
    spec = await asyncio.get_running_loop().run_in_executor(None, parse_request, body, is_chat, info,
                                                            frozenset(adapters.names()))
    adapter = adapters.get(spec.lora_name) if spec.lora_name is not None else None
    if spec.lora_name is not None and adapter is None:   # unloaded while the body was parsed
        raise OpenAIError(404, f"model: {spec.lora_name!r} is not served here", "model", "model_not_found")
    latency = bridge.metrics.latency if bridge.metrics is not None else None
    run = ChoiceRun(bridge, spec, info, latency, adapter)
    shape = _Shape(is_chat, ("chatcmpl-" if is_chat else "cmpl-") + uuid.uuid4().hex, int(time.time()),
                   spec.lora_name or info.name, spec.top_logprobs)
    if adapter is not None:
        adapters.acquire(adapter.name)
    try:
        run.submit()
        first = await run.next_update()   # an error before the first token is still an HTTP status
        if spec.stream:
            return await _stream(request, run, first, shape)
        await run.run_to_end()
        return json_response(shape.full(run))
    finally:   # done: a no-op; a disconnect (handler cancelled) or an error: the engine requests stop
        run.close()
        if adapter is not None:
            adapters.release(adapter.name)


async def _stream(request: web.Request, run: ChoiceRun, update: ChoiceUpdate, shape: "_Shape") -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    usage_field = {"usage": None} if run.spec.include_usage else {}

    async def send(body: dict) -> None:
        await response.write(b"data: " + orjson.dumps(body) + b"\n\n")

    if shape.is_chat:   # the role first, once per choice (as OpenAI's first chunk)
        for choice in run.choices:
            await send(shape.chunk([{"index": choice.index, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}]) | usage_field)
    while True:
        if update.text or update.log_probs or update.finish_reason or update.tool_calls:
            await send(shape.chunk([shape.chunk_choice(update, run.spec.logprobs)]) | usage_field)
        if run.is_done:
            break
        try:
            update = await run.next_update()
        except OpenAIError as e:   # after the headers: an error event, as vLLM sends
            await send(e.body())
            break
    if run.spec.include_usage:
        await send(shape.chunk([]) | {"usage": _usage(run)})
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def _usage(run: ChoiceRun) -> dict:
    """prompt_tokens: each prompt once (n choices of a prompt share it, as OpenAI counts);
    completion_tokens: every choice's generated tokens up to its end (a stop string's last token)."""
    prompt, completion = run.num_prompt_tokens, run.num_completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class _Shape:
    """OpenAI's response and chunk objects for one request (completion or chat)."""

    def __init__(self, is_chat: bool, response_id: str, created: int, model: str, top_logprobs: int = 0):
        self.is_chat, self.response_id, self.created, self.model = is_chat, response_id, created, model
        self.top_logprobs = top_logprobs

    def _head(self, object_name: str) -> dict:
        return {"id": self.response_id, "object": object_name, "created": self.created, "model": self.model}

    def log_probs(self, entries: list[TokenLogProb] | tuple[TokenLogProb, ...]) -> dict:
        """`token`: the characters the token completes (never part of one: joined, the text);
        `bytes`: the token's own bytes (joined, the text's UTF-8)."""
        if self.is_chat:
            return {"content": [{"token": e.token, "logprob": e.log_prob, "bytes": list(e.token_bytes),
                                 "top_logprobs": [{"token": t, "logprob": v, "bytes": list(b)} for t, v, b in e.top]}
                                for e in entries]}
        return {"tokens": [e.token for e in entries], "token_logprobs": [e.log_prob for e in entries],
                "top_logprobs": [{t: v for t, v, _ in e.top} for e in entries] if self.top_logprobs else None,
                "text_offset": [e.text_offset for e in entries]}

    def chunk(self, choices: list[dict]) -> dict:
        return self._head("chat.completion.chunk" if self.is_chat else "text_completion") | {"choices": choices}

    def chunk_choice(self, update: ChoiceUpdate, with_log_probs: bool) -> dict:
        log_probs = self.log_probs(update.log_probs) if with_log_probs else None
        if self.is_chat:
            delta = {"content": update.text} if update.text else {}
            if update.tool_calls:
                delta["tool_calls"] = [call.openai() for call in update.tool_calls]
            return {"index": update.index, "delta": delta, "logprobs": log_probs, "finish_reason": update.finish_reason}
        return {"index": update.index, "text": update.text, "logprobs": log_probs,
                "finish_reason": update.finish_reason}

    def full(self, run: ChoiceRun) -> dict:
        choices = []
        for choice in run.choices:
            text = "".join(choice.text)
            log_probs = self.log_probs(choice.log_probs) if run.spec.logprobs else None
            if self.is_chat:
                message = {"role": "assistant", "content": text}
                if choice.tools is not None and choice.tools.calls:
                    message = {"role": "assistant", "content": text or None,
                               "tool_calls": [call.openai() for call in choice.tools.calls]}
                choices.append({"index": choice.index, "message": message, "logprobs": log_probs,
                                "finish_reason": choice.finish_reason})
            else:
                choices.append({"index": choice.index, "text": text, "logprobs": log_probs,
                                "finish_reason": choice.finish_reason})
        return self._head("chat.completion" if self.is_chat else "text_completion") | {
            "choices": choices, "usage": _usage(run)}


def add_routes(app: web.Application, info: ModelInfo, bridge, max_loras: int = DEFAULT_MAX_LORAS) -> None:
    """The OpenAI routes, and the LoRA adapters' (lora_routes: at most max_loras loaded)."""
    app[CONTEXT] = OpenAIContext(info, bridge, int(time.time()))
    metrics = getattr(getattr(bridge, "metrics", None), "vllm", None)
    add_lora_routes(app, LoraAdapters(info.name, max_loras, metrics))
    app.add_routes([web.get("/v1/models", handle_models), web.get("/v1/models/{model}", handle_model),
                    web.post("/v1/completions", handle_completions),
                    web.post("/v1/chat/completions", handle_chat_completions)])
