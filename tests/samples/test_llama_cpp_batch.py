"""The batch comparison's own side: the W64 mix is the benchmark's default dataset, and our W64 and
prefill measurements run every request to its length on an engine built from a random LLaMA file
(the llama.cpp side needs the xllamacpp wheel and is not run here)."""
from __future__ import annotations

from runtime import build_engine
from samples.benchmark.dataset import LengthDistribution, synthetic_dataset
from samples.microbench.llama_cpp_batch import our_prefill, our_w64, prefill_prompt, w64_requests
from samples.microbench.random_llama import LlamaShape, write_random_llama

TINY = LlamaShape(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256,
                  vocab_size=600)


def test_the_w64_mix_is_the_benchmarks_default():
    requests = w64_requests(600)
    expected = synthetic_dataset(64, LengthDistribution.parse("p", "uniform:16:256"),
                                 LengthDistribution.parse("o", "uniform:16:128"), 600, 0, 2048)
    assert requests == [(s.input_ids, s.output_len) for s in expected]
    prompt = prefill_prompt(600)
    assert len(prompt) == 512 and all(3 <= t < 600 for t in prompt) and prompt == prefill_prompt(600)


def test_our_side_runs_every_request_to_its_length(tmp_path):
    build_engine(write_random_llama(str(tmp_path / "m.gguf"), "F32", TINY), tmp_path / "engine")
    requests = [(list(range(10 + i, 30 + i)), 3 + i) for i in range(5)]
    assert our_w64(str(tmp_path / "engine"), requests, 1) > 0   # raises unless 3 + 4 + ... + 7 tokens came back
    assert our_prefill(str(tmp_path / "engine"), prefill_prompt(600), 1) > 0
