"""Kept GGUF blocks under tensor parallelism: 2 gloo ranks, each holding its slices of the file's
blocks (whole rows of the column-parallel weights and of the vocabulary, whole blocks of the
row-parallel weights' columns), give the logits of one process running the same kept blocks: read
sliced from the .gguf file or from an engine built with keep, or sliced in memory; a tied Q8_0
table looked up by vocabulary range and an odd vocabulary padding the kept head with zero blocks."""
from __future__ import annotations

import pytest
import torch

from runtime import Engine, ModelRunner, build_engine
from runtime.parallel.tensor_parallel import WorldConfig, init_tensor_parallel
from runtime.quantization.block_weights import block_bases
from runtime.quantization.gguf_blocks import BLOCK_FORMATS
from tests import factories
from tests.runtime.gguf_factories import Q, write_gguf
from tests.runtime.test_tensor_parallel import NUM_BLOCKS, TOLERANCE, _forwards, pool  # noqa: F401 (fixture)

# case -> (model overrides, the format of each 2-D tensor by GGUF name). Rank column spans: heads 2 x 16
# and intermediate 128 / 2: whole blocks of 32.
CASES = {
    "q4_1_tied_q8_0_table": (dict(tie_word_embeddings=True),
                             lambda name: "q8_0" if name == "token_embd.weight" else "q4_1"),
    "q5_0_q8_0_odd_vocab": (dict(vocab_size=129), lambda name: "q8_0" if "attn_v" in name else "q5_0"),
}


def write_case(path, case: str) -> str:
    overrides, choose = CASES[case]
    model = factories.hf_model("llama", 4, intermediate_size=128, **overrides)

    def stored(name, w):
        fmt = BLOCK_FORMATS[choose(name)]
        return fmt.quantize(w), Q[fmt.type_name]

    return write_gguf(path, "llama", model, stored)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """case -> (.gguf file, engine dir built from it with keep)."""
    out = {}
    for case in CASES:
        root = tmp_path_factory.mktemp(case)
        path = write_case(root / "m.gguf", case)
        build_engine(path, root / "engine", weight_format="keep")
        out[case] = (path, str(root / "engine"))
    return out


def rank_forwards(path: str, sharded_load: bool) -> list[dict]:
    tp = init_tensor_parallel(WorldConfig(tensor_parallelism=2), torch.device("cpu"))
    engine = Engine.from_dir(path, (tp.rank, tp.size) if sharded_load else None, weight_format="keep")
    assert block_bases(engine.weights)
    runner = ModelRunner(engine, NUM_BLOCKS, tensor_parallel=tp)
    return [{k: v.clone() for k, v in out.items()} for out in _forwards(runner, engine.model_config.vocab_size)]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("source, sharded_load", [("gguf", True), ("engine", True), ("engine", False)])
def test_two_ranks_match_one_process(pool, files, case, source, sharded_load):
    gguf_path, engine_dir = files[case]
    path = gguf_path if source == "gguf" else engine_dir
    engine = Engine.from_dir(path, weight_format="keep")
    expected = _forwards(ModelRunner(engine, NUM_BLOCKS), engine.model_config.vocab_size)
    for outputs in pool.run(rank_forwards, path, sharded_load):
        for got, want in zip(outputs, expected):
            assert got["logits"].shape == want["logits"].shape
            torch.testing.assert_close(got["logits"], want["logits"], atol=TOLERANCE, rtol=0)
            torch.testing.assert_close(got["context_logits"], want["context_logits"], atol=TOLERANCE, rtol=0)
