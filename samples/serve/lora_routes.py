"""LoRA adapters loaded at run time, vLLM's way (the fleet protocol): `POST /v1/load_lora_adapter`
{"lora_name", "lora_path"} converts a Hugging Face PEFT directory (batch_manager.load_peft_adapter)
and gives it a task id of the engine's PEFT cache; a request whose `model` is that name runs with
the adapter (its weights travel with each request, so an adapter the cache evicted is simply sent
again); `POST /v1/unload_lora_adapter` {"lora_name"} forgets it once no request uses it. Every
error names the field: 400 a bad value or path, 404 an unknown name, 409 a name taken or in use."""
from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass

from aiohttp import web

from samples.serve.openai_basics import OpenAIError
from samples.serve.value_repr import short_repr

DEFAULT_MAX_LORAS = 8


@dataclass(frozen=True)
class LoadedAdapter:
    name: str
    path: str
    task_id: int         # the PEFT cache's key (one per load: a reloaded name gets a new one)
    weights: object      # [N, W] float tensor, TensorRT-LLM's layout
    config: object       # int32 [N, 3]


class LoraAdapters:
    """name -> LoadedAdapter, and how many requests use each (the event loop's, single-threaded)."""

    def __init__(self, base_name: str, max_loras: int = DEFAULT_MAX_LORAS, metrics=None):
        """metrics: samples.serve.vllm_metrics.VllmMetrics (its LoRA info follows the requests)."""
        self.base_name, self.max_loras, self.metrics = base_name, max_loras, metrics
        self._adapters: dict[str, LoadedAdapter] = {}
        self._num_users: dict[str, int] = {}
        self._next_task_id = 1
        if metrics is not None:
            metrics.max_lora = max_loras
            metrics.set_lora_adapters([], [])

    def names(self) -> list[str]:
        return sorted(self._adapters)

    def get(self, name: str) -> LoadedAdapter | None:
        return self._adapters.get(name)

    def check_new(self, name, path) -> None:
        """OpenAIError naming the field for a load that cannot be done."""
        if not isinstance(name, str) or not name.strip() or len(name) > 256:
            raise OpenAIError(400, f"lora_name: expected a non-empty name, got {short_repr(name)}", "lora_name")
        if name == self.base_name or name in self._adapters:
            raise OpenAIError(409, f"lora_name: {name!r} is already served here", "lora_name")
        if len(self._adapters) >= self.max_loras:
            raise OpenAIError(409, f"lora_name: {self.max_loras} adapters are loaded (the most this server holds); "
                                   "unload one first", "lora_name")
        if not isinstance(path, str) or not os.path.isfile(os.path.join(path, "adapter_config.json")):
            raise OpenAIError(400, f"lora_path: {short_repr(path)} is not a PEFT adapter directory (no "
                                   "adapter_config.json)", "lora_path")

    def add(self, name: str, path: str, weights, config) -> LoadedAdapter:
        adapter = LoadedAdapter(name, path, self._next_task_id, weights, config)
        self._next_task_id += 1
        self._adapters[name] = adapter
        return adapter

    def remove(self, name) -> None:
        if not isinstance(name, str) or name not in self._adapters:
            raise OpenAIError(404, f"lora_name: {short_repr(name)} is not a loaded adapter", "lora_name",
                              "model_not_found")
        if self._num_users.get(name):
            raise OpenAIError(409, f"lora_name: {name!r} is used by {self._num_users[name]} running request(s)",
                              "lora_name")
        del self._adapters[name]

    def acquire(self, name: str) -> None:
        self._num_users[name] = self._num_users.get(name, 0) + 1
        self._report()

    def release(self, name: str) -> None:
        self._num_users[name] -= 1
        if not self._num_users[name]:
            del self._num_users[name]
        self._report()

    def _report(self) -> None:
        if self.metrics is not None:
            self.metrics.set_lora_adapters(list(self._num_users), [])


ADAPTERS = web.AppKey("lora_adapters", LoraAdapters)


async def _body(request: web.Request) -> dict:
    try:
        body = json.loads(await request.read())
    except ValueError as e:
        raise OpenAIError(400, f"body: not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise OpenAIError(400, f"body: expected a JSON object, got {type(body).__name__}")
    return body


async def handle_load(request: web.Request) -> web.Response:
    adapters, body = request.app[ADAPTERS], await _body(request)
    name, path = body.get("lora_name"), body.get("lora_path")
    adapters.check_new(name, path)
    from batch_manager import load_peft_adapter
    try:   # off the loop: reading and converting the weights takes a while
        weights, config = await asyncio.get_running_loop().run_in_executor(None, load_peft_adapter, path)
    except (ValueError, OSError, KeyError) as e:
        raise OpenAIError(400, f"lora_path: {path!r} could not be loaded: {e}", "lora_path") from None
    adapters.check_new(name, path)   # another load of the name may have finished meanwhile
    adapters.add(name, path, weights, config)
    return web.json_response({"status": "ok", "lora_name": name})


async def handle_unload(request: web.Request) -> web.Response:
    adapters, body = request.app[ADAPTERS], await _body(request)
    adapters.remove(body.get("lora_name"))
    return web.json_response({"status": "ok", "lora_name": body["lora_name"]})


def add_routes(app: web.Application, adapters: LoraAdapters) -> None:
    app[ADAPTERS] = adapters
    app.add_routes([web.post("/v1/load_lora_adapter", handle_load), web.post("/v1/unload_lora_adapter", handle_unload)])
