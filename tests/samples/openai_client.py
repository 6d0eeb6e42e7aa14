"""The OpenAI endpoint tests' shared pieces: the served model's name and key, the official clients
against a test server, its idle check, and the server over the scripted model (scripted_model)."""
from __future__ import annotations

import time

import aiohttp
import openai

from tests.samples.conftest import ServerThread, kv_of_bridge

API_KEY = "test-key"
MODEL = "scripted"
MAX_BODY_BYTES = 64 << 10
PROMPT = "Say:"            # ends with a token outside the reply: the reply starts at once
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Greet me 👋"}]


def start_server(scripted, api: str, max_body_bytes: int = MAX_BODY_BYTES) -> ServerThread:
    """The app with its OpenAI routes over the scripted engine, the API key set, a small body limit."""
    from samples.serve.launch import model_info
    tokenizer, _, engine_dir = scripted
    return ServerThread(engine_dir, tokenizer, api=api, model_info=model_info(engine_dir, tokenizer, MODEL),
                        api_key=API_KEY, max_body_bytes=max_body_bytes)


def client(server, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=kwargs.pop("api_key", API_KEY), max_retries=0,
                         timeout=30, **kwargs)


def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=30)


def chat_prompt_ids(tokenizer) -> list[int]:
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def assert_idle(server) -> None:
    """Nothing running or waiting, every KV block free again (within a few seconds)."""
    deadline = time.monotonic() + 5
    while (server.bridge.num_active_requests() or server.bridge.num_waiting_handlers()) \
            and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.bridge.num_active_requests() == 0 and server.bridge.num_waiting_handlers() == 0
    kv = kv_of_bridge(server.bridge)
    assert kv.num_free_blocks == kv.num_blocks


async def raw_post(url: str, path: str, data: bytes, key: str | None = API_KEY) -> tuple[int, str]:
    """(status, body text) of a POST with the key (or none)."""
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.post(url + path, data=data, headers={**headers, "Content-Type": "application/json"}) \
                as response:
            return response.status, await response.text()
