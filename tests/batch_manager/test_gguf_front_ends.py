"""A `.gguf` file served directly: GptManager and the Executor load it through Engine.from_dir and give
GptSession's greedy tokens on it; GuidedDecodingConfig.from_tokenizer accepts it."""
from __future__ import annotations

import os

import pytest
import torch

from batch_manager import GuidedDecodingConfig, KvCacheConfig
from batch_manager.executor import KvCacheConfig as ExecutorKvCacheConfig
from batch_manager.executor import Request
from runtime import Engine, GenerationInput, GenerationOutput, GptSession, SamplingConfig, WorldConfig
from runtime import save_gguf_tokenizer
from tests import factories
from tests.batch_manager.executor.helpers import collect, executor_for, final_tokens, gpt_manager_tokens
from runtime.kernels.torch_kernels import block_linear
from tests.runtime.gguf_factories import Q, ReferenceBlockOps, write_gguf

pytest.importorskip("transformers")
PROMPTS = [[5, 9, 40, 41, 17], [70, 3, 3, 99, 12, 8, 64, 1, 30], [100]]
NUM_NEW_TOKENS = 6


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    """A tiny LLaMA as a Q8_0 GGUF file."""
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", "llama", factories.hf_model("llama", seed=9),
                      Q.Q8_0)


@pytest.fixture(scope="module")
def session_tokens(gguf_path):
    """Prompt + greedy tokens of each prompt, from GptSession over Engine.from_dir(the file)."""
    engine = Engine.from_dir(gguf_path)
    session = GptSession(GptSession.Config(max_batch_size=len(PROMPTS), max_beam_width=1, max_sequence_length=32),
                         engine.model_config, WorldConfig(), engine)
    output = GenerationOutput()
    ids = torch.tensor([t for p in PROMPTS for t in p], dtype=torch.int32)
    session.generate(output, GenerationInput(end_id=-1, pad_id=0, ids=ids, packed=True, max_new_tokens=NUM_NEW_TOKENS,
                                             lengths=torch.tensor([len(p) for p in PROMPTS], dtype=torch.int32)),
                     SamplingConfig())
    return [output.ids[i, 0, :len(p) + NUM_NEW_TOKENS].tolist() for i, p in enumerate(PROMPTS)]


def test_gpt_manager_serves_a_gguf_file(gguf_path, session_tokens):
    got = gpt_manager_tokens(gguf_path, [(p, NUM_NEW_TOKENS, {}) for p in PROMPTS], False, 1,
                             KvCacheConfig(max_tokens=256))
    assert [beams[0] for beams in got] == session_tokens


def test_executor_serves_a_gguf_file(gguf_path, session_tokens):
    with executor_for(gguf_path, kv_cache_config=ExecutorKvCacheConfig(max_tokens=256)) as executor:
        ids = executor.enqueue_requests([Request(p, NUM_NEW_TOKENS) for p in PROMPTS])
        responses = collect(executor, ids)
    assert [final_tokens(responses[i], False)[0] for i in ids] == session_tokens


def test_front_ends_keep_the_files_blocks_where_the_native_kernels_run(gguf_path, session_tokens, monkeypatch):
    """weight_format "auto" with native block kernels (a float32 stand-in with their API): GptManager
    and the Executor run the file's Q8_0 blocks through them, with the de-quantized engine's tokens."""
    ops = ReferenceBlockOps()
    monkeypatch.setattr(block_linear, "block_ops", lambda: ops)
    got = gpt_manager_tokens(gguf_path, [(p, NUM_NEW_TOKENS, {}) for p in PROMPTS], False, 1,
                             KvCacheConfig(max_tokens=256))
    assert [beams[0] for beams in got] == session_tokens
    assert {fmt for op, fmt, _ in ops.calls if op == "linear"} == {"q8_0"}
    ops.calls.clear()
    with executor_for(gguf_path, kv_cache_config=ExecutorKvCacheConfig(max_tokens=256)) as executor:
        ids = executor.enqueue_requests([Request(p, NUM_NEW_TOKENS) for p in PROMPTS])
        responses = collect(executor, ids)
    assert [final_tokens(responses[i], False)[0] for i in ids] == session_tokens
    assert ops.calls


def test_guided_decoding_config_from_a_gguf_file(gguf_path, tmp_path):
    config = GuidedDecodingConfig.from_tokenizer(gguf_path)
    save_gguf_tokenizer(gguf_path, tmp_path)
    assert config.tokenizer_str == (tmp_path / "tokenizer.json").read_text(encoding="utf-8")
    assert config.stop_token_ids == [2]   # the file's eos, </s>
    config.build_compiler(128)
    assert sorted(os.listdir(os.path.dirname(gguf_path))) == ["tiny.gguf"]
