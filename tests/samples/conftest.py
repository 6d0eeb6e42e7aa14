"""Fixtures for the samples' tests: a tiny engine, a local tokenizer, the real HTTP server on a
loopback port (its own event loop on a thread) and an aiohttp client runner."""
from __future__ import annotations

import asyncio
import threading

import pytest

from batch_manager import KvCacheConfig, SchedulerPolicy, TrtGptModelOptionalParams, TrtGptModelType
from runtime import build_engine
from tests.factories import make_checkpoint


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory):
    """(HF checkpoint dir, engine dir, transformers model) of a tiny LLaMA (vocab 128) with small
    limits and 4-token blocks."""
    root = tmp_path_factory.mktemp("samples")
    model = make_checkpoint(root / "hf", "llama")
    build_engine(root / "hf", root / "engine", tokens_per_block=4, max_batch_size=8, max_input_len=48,
                 max_seq_len=96, max_num_tokens=128)
    return str(root / "hf"), str(root / "engine"), model


def greedy_reference(model, prompt: list[int], num_new_tokens: int) -> list[int]:
    """transformers' greedy continuation (generated tokens only)."""
    import torch
    ids = model.generate(torch.tensor([prompt]), max_new_tokens=num_new_tokens, min_new_tokens=num_new_tokens,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return ids[0, len(prompt):].tolist()


@pytest.fixture(scope="session")
def scripted(tmp_path_factory):
    """(tokenizer, Script, engine dir) of the scripted tiny model and its byte-level BPE (scripted_model)."""
    import transformers
    from tests.samples.scripted_model import MAX_SEQ_LEN, Script, write_scripted_model, write_tokenizer
    root = tmp_path_factory.mktemp("scripted")
    write_tokenizer(str(root / "tokenizer"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(root / "tokenizer"), local_files_only=True)
    script = Script(tokenizer)
    write_scripted_model(str(root / "hf"), script)
    build_engine(root / "hf", root / "engine", tokens_per_block=8, max_batch_size=16, max_input_len=256,
                 max_seq_len=MAX_SEQ_LEN, max_num_tokens=512)
    return tokenizer, script, str(root / "engine")


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    """A word-level tokenizer over the tiny vocabulary: token i is the word `t{i}`."""
    import tokenizers
    import transformers
    vocab = {"[PAD]": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, 128)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[PAD]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", bos_token="<s>",
                                                eos_token="</s>")
    directory = tmp_path_factory.mktemp("tokenizer")
    fast.save_pretrained(directory)
    return str(directory)


class ServerThread:
    """samples.serve's app on 127.0.0.1 (a free port), served by an event loop on its own thread."""

    def __init__(self, engine_dir: str, tokenizer=None, num_kv_tokens: int | None = None, metrics=None,
                 api: str = "gpt_manager", max_queue_size: int | None = None, guided_decoding_config=None,
                 max_num_queued_tokens: int | None = None, ttft_budget_ms: float | None = None, bridge=None,
                 **app_options):
        """app_options: create_app's (model_info for the OpenAI endpoints, api_key, max_body_bytes);
        guided_decoding_config: the engine's (tools); the load bounds as the server's flags; bridge:
        one made elsewhere (samples.serve.launch.make_bridge), instead of the arguments above."""
        from samples.serve.server import start_server
        from samples.serve.bridge import ManagerBridge
        from samples.serve.metrics import TritonMetrics
        metrics = metrics or TritonMetrics(False)
        if bridge is not None:
            self.bridge = bridge
        elif api == "executor":
            from batch_manager.executor import ExecutorConfig, KvCacheConfig as ExecutorKvCacheConfig
            from samples.serve.executor_bridge import ExecutorBridge
            config = ExecutorConfig(kv_cache_config=ExecutorKvCacheConfig(max_tokens=num_kv_tokens),
                                    max_queue_size=max_queue_size, max_num_queued_tokens=max_num_queued_tokens,
                                    guided_decoding_config=guided_decoding_config)
            self.bridge = ExecutorBridge(engine_dir, config, metrics, ttft_budget_ms)
        else:
            params = TrtGptModelOptionalParams(kv_cache_config=KvCacheConfig(max_tokens=num_kv_tokens),
                                               guided_decoding_config=guided_decoding_config)
            self.bridge = ManagerBridge(engine_dir, TrtGptModelType.InflightFusedBatching, 1,
                                        SchedulerPolicy.GUARANTEED_NO_EVICT, params, metrics, max_queue_size,
                                        max_num_queued_tokens, ttft_budget_ms)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-http-server", daemon=True)
        self.thread.start()
        self.runner, self.port = asyncio.run_coroutine_threadsafe(
            start_server(self.bridge, "127.0.0.1", 0, tokenizer, default_max_new_tokens=8, **app_options),
            self.loop).result(30)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.bridge.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module", params=["gpt_manager", "executor"])
def server(tiny_model_dirs, tokenizer_dir, request):
    """The server over each front-end: GptManager's callbacks, the Executor's queues."""
    from samples.serve.launch import load_tokenizer
    s = ServerThread(tiny_model_dirs[1], load_tokenizer(tokenizer_dir), api=request.param)
    yield s
    s.stop()


def run(coroutine_fn, *args, timeout_s: float = 60.0):
    """Run an async client function to completion on a fresh event loop (the test's thread)."""
    async def bounded():
        return await asyncio.wait_for(coroutine_fn(*args), timeout_s)
    return asyncio.run(bounded())


def kv_of_bridge(bridge):
    """The KV block manager behind either bridge (internal: block accounting)."""
    return (bridge.executor if hasattr(bridge, "executor") else bridge.manager).kv_cache_manager
