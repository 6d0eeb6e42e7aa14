"""Numerical parity of the runtime with transformers (fp32 reference) for every architecture:
packed mixed steps, sliding windows, rope scaling, checkpoint layouts, GptSession generation,
gathered logits and half-precision engines."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime import (Engine, GenerationInput, GenerationOutput, GptSession, ModelRunner, SamplingConfig,
                     WorldConfig)
from runtime.kernels.torch_kernels.linear import CPU_IMPLS, onednn_available
from tests.factories import make_checkpoint, step_inputs

ARCHS = ("gpt2", "llama", "mistral", "qwen2")
ATOL = 1e-4
NUM_NEW_TOKENS = 32
NO_END_ID = -1  # never produced by argmax: generation runs to max_new_tokens


def random_tokens(n: int, seed: int, vocab: int = 128) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    """transformers' full forward: float32 [len(tokens), V]."""
    return model(torch.tensor([tokens])).logits[0].float()


def run_prompt(runner: ModelRunner, tokens: list[int], blocks: list[int]) -> torch.Tensor:
    """One fresh context step for one sequence -> its context logits [len(tokens), V]."""
    return runner.forward(step_inputs([(tokens, 0, blocks)], context_logits=True))["context_logits"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """arch -> (checkpoint dir, transformers model with the same weights)."""
    out = {}
    for seed, arch in enumerate(ARCHS):
        path = tmp_path_factory.mktemp(arch)
        out[arch] = (path, make_checkpoint(path, arch, seed=seed))
    return out


@pytest.fixture(scope="module")
def prompts():
    return [random_tokens(n, seed=100 + n) for n in (5, 13, 1, 9)]


@pytest.fixture(scope="module")
def hf_greedy(checkpoints, prompts):
    """arch -> transformers' greedy continuation (NUM_NEW_TOKENS tokens, no eos) of each prompt."""
    out = {}
    for arch, (_, model) in checkpoints.items():
        out[arch] = []
        for p in prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=NUM_NEW_TOKENS, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)[0].tolist()
            assert len(ids) == len(p) + NUM_NEW_TOKENS
            out[arch].append(ids[len(p):])
    return out


# --- ModelRunner.forward ------------------------------------------------------------------------

LINEAR_IMPLS = [impl for impl in CPU_IMPLS if impl != "onednn" or onednn_available(torch.float32)]


@pytest.mark.parametrize("linear_impl", LINEAR_IMPLS)
@pytest.mark.parametrize("arch", ARCHS)
def test_packed_mixed_step_matches_transformers(checkpoints, arch, linear_impl):
    path, model = checkpoints[arch]
    runner = ModelRunner(Engine.from_dir(path, tokens_per_block=4), num_blocks=64, linear_impl=linear_impl)
    assert all(linear.impl == linear_impl for linear in [*runner.model.linears.values(), runner.model.lm_head])
    fresh = [random_tokens(n, seed=n) for n in (3, 11, 20)]
    cached = [random_tokens(n, seed=50 + n) for n in (8, 17)]  # last token is the generation input
    chunked = random_tokens(14, seed=7)                         # 6 cached, 8 new in the mixed step
    blocks = {name: list(range(8 * i, 8 * i + 8)) for i, name in enumerate("abcdef")}
    runner.forward(step_inputs([(cached[0][:-1], 0, blocks["d"]), (cached[1][:-1], 0, blocks["e"]),
                                (chunked[:6], 0, blocks["f"])]))

    # Order mixes the phases: generation sequences sit between context sequences.
    seqs = [(fresh[0], 0, blocks["a"]), (cached[0][-1:], 7, blocks["d"]), (fresh[1], 0, blocks["b"]),
            (chunked[6:], 6, blocks["f"]), (cached[1][-1:], 16, blocks["e"]), (fresh[2], 0, blocks["c"])]
    full_tokens = [fresh[0], cached[0], fresh[1], chunked, cached[1], fresh[2]]
    out = runner.forward(step_inputs(seqs, context_logits=True))

    assert out["logits"].shape == (6, 128) and out["logits"].dtype == torch.float32
    assert out["context_logits"].shape == (sum(len(new) for new, _, _ in seqs), 128)
    offset = 0
    for i, ((new, past, _), tokens) in enumerate(zip(seqs, full_tokens)):
        ref = hf_logits(model, tokens)
        torch.testing.assert_close(out["logits"][i], ref[-1], atol=ATOL, rtol=0)
        torch.testing.assert_close(out["context_logits"][offset:offset + len(new)], ref[past:], atol=ATOL, rtol=0)
        offset += len(new)


def test_context_logits_only_for_flagged_sequences(checkpoints):
    path, model = checkpoints["llama"]
    runner = ModelRunner(Engine.from_dir(path, tokens_per_block=4), num_blocks=16)
    a, b, c = random_tokens(5, 1), random_tokens(7, 2), random_tokens(3, 3)
    inputs = step_inputs([(a, 0, [0, 1]), (b, 0, [2, 3]), (c, 0, [4])])
    inputs["return_context_logits"] = torch.tensor([True, False, True])
    out = runner.forward(inputs)
    assert out["context_logits"].shape == (len(a) + len(c), 128)
    torch.testing.assert_close(out["context_logits"][len(a):], hf_logits(model, c), atol=ATOL, rtol=0)
    assert "context_logits" not in runner.forward(step_inputs([(a, 0, [0, 1])]))


def test_mistral_sliding_window_longer_than_window(checkpoints):
    path, model = checkpoints["mistral"]
    assert model.config.sliding_window == 8
    runner = ModelRunner(Engine.from_dir(path, tokens_per_block=4), num_blocks=32)
    tokens = random_tokens(36, seed=11)
    ref = hf_logits(model, tokens)
    model.config.sliding_window = None
    try:  # the window must matter for this sequence, or the test could not fail
        assert (hf_logits(model, tokens)[-1] - ref[-1]).abs().max() > 1e-2
    finally:
        model.config.sliding_window = 8

    torch.testing.assert_close(run_prompt(runner, tokens, list(range(9))), ref, atol=ATOL, rtol=0)
    blocks = list(range(9, 18))
    num_prompt = 5
    logits = runner.forward(step_inputs([(tokens[:num_prompt], 0, blocks)]))["logits"]
    torch.testing.assert_close(logits[0], ref[num_prompt - 1], atol=ATOL, rtol=0)
    for pos in range(num_prompt, len(tokens)):
        logits = runner.forward(step_inputs([([tokens[pos]], pos, blocks)]))["logits"]
        torch.testing.assert_close(logits[0], ref[pos], atol=ATOL, rtol=0, msg=f"position {pos}")


ROPE_VARIANTS = {
    "theta": dict(rope_theta=50000.0),
    "linear": dict(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}),
    # original_max_position_embeddings=64 puts the head_dim-16 frequencies in all three llama3 bands.
    "llama3": dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                                    "rope_theta": 500000.0}),
}


@pytest.mark.parametrize("variant", sorted(ROPE_VARIANTS))
def test_llama_rope_variants_match_transformers(tmp_path, variant):
    model = make_checkpoint(tmp_path, "llama", seed=1, **ROPE_VARIANTS[variant])
    engine = Engine.from_dir(tmp_path, tokens_per_block=16)
    assert engine.model_config.rope.scaling_type == ("default" if variant == "theta" else variant)
    tokens = random_tokens(60, seed=3)
    ref = hf_logits(model, tokens)
    runner = ModelRunner(engine, num_blocks=8)
    torch.testing.assert_close(run_prompt(runner, tokens, [0, 1, 2, 3]), ref, atol=ATOL, rtol=0)
    # A generation step rotates with the same frequencies as the context step.
    runner.forward(step_inputs([(tokens[:-1], 0, [4, 5, 6, 7])]))
    logits = runner.forward(step_inputs([(tokens[-1:], 59, [4, 5, 6, 7])]))["logits"]
    torch.testing.assert_close(logits[0], ref[-1], atol=ATOL, rtol=0)
    # The variant must change the logits relative to the unscaled, theta-10000 model.
    default = make_checkpoint(tmp_path / "default", "llama", seed=1)
    assert (hf_logits(default, tokens) - ref).abs().max() > 1e-2


def test_legacy_rope_scaling_fields_read_like_rope_parameters(tmp_path):
    """transformers 4 wrote rope_theta + rope_scaling {"type": ...}; transformers 5 rope_parameters."""
    make_checkpoint(tmp_path, "llama", seed=1, **ROPE_VARIANTS["llama3"])
    new_style = Engine.from_dir(tmp_path).model_config
    config = json.loads((tmp_path / "config.json").read_text())
    params = config.pop("rope_parameters")
    config["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    config["rope_scaling"] = params
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert Engine.from_dir(tmp_path).model_config == new_style


# --- checkpoint layouts -------------------------------------------------------------------------

def test_qwen2_untied_embeddings(tmp_path):
    model = make_checkpoint(tmp_path, "qwen2", seed=4, tie_word_embeddings=False)
    engine = Engine.from_dir(tmp_path)
    assert engine.model_config.tie_word_embeddings is False
    assert not torch.equal(engine.weights["lm_head"], engine.weights["embed_tokens"])
    tokens = random_tokens(12, seed=4)
    torch.testing.assert_close(run_prompt(ModelRunner(engine, 4), tokens, [0]), hf_logits(model, tokens),
                               atol=ATOL, rtol=0)


def test_tied_checkpoint_has_no_lm_head(checkpoints):
    engine = Engine.from_dir(checkpoints["qwen2"][0])
    assert engine.model_config.tie_word_embeddings is True
    assert "lm_head" not in engine.weights


def test_gpt2_checkpoint_without_transformer_prefix(checkpoints, tmp_path):
    """A GPT2Model-style checkpoint names its tensors `wte.weight`, `h.0...` (no `transformer.`)."""
    path, model = checkpoints["gpt2"]
    tensors = load_file(os.path.join(path, "model.safetensors"))
    assert all(name.startswith("transformer.") for name in tensors)
    save_file({name.removeprefix("transformer."): t for name, t in tensors.items()},
              os.fspath(tmp_path / "model.safetensors"))
    shutil.copy(os.path.join(path, "config.json"), tmp_path / "config.json")
    prefixed, bare = Engine.from_dir(path), Engine.from_dir(tmp_path)
    assert prefixed.weights.keys() == bare.weights.keys()
    for name in prefixed.weights:
        assert torch.equal(prefixed.weights[name], bare.weights[name]), name
    tokens = random_tokens(10, seed=5)
    torch.testing.assert_close(run_prompt(ModelRunner(bare, 4), tokens, [0]), hf_logits(model, tokens),
                               atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_sharded_checkpoint_loads_identically(checkpoints, tmp_path, arch):
    path, _ = checkpoints[arch]
    make_checkpoint(tmp_path, arch, seed=ARCHS.index(arch), max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    whole, sharded = Engine.from_dir(path), Engine.from_dir(tmp_path)
    assert whole.model_config == sharded.model_config
    assert whole.weights.keys() == sharded.weights.keys()
    for name in whole.weights:
        assert torch.equal(whole.weights[name], sharded.weights[name]), name


# --- GptSession -------------------------------------------------------------------------------

def make_session(engine: Engine, max_sequence_length: int = 64) -> GptSession:
    config = GptSession.Config(max_batch_size=4, max_beam_width=1, max_sequence_length=max_sequence_length)
    return GptSession(config, engine.model_config, WorldConfig(), engine)


def generation_input(prompts: list[list[int]], packed: bool, end_id: int, pad_id: int) -> GenerationInput:
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.int32)
    if packed:
        ids = torch.tensor([t for p in prompts for t in p], dtype=torch.int32)
    else:
        ids = torch.full((len(prompts), max(map(len, prompts))), pad_id, dtype=torch.int32)
        for i, p in enumerate(prompts):
            ids[i, :len(p)] = torch.tensor(p)
    return GenerationInput(end_id=end_id, pad_id=pad_id, ids=ids, lengths=lengths, packed=packed,
                           max_new_tokens=NUM_NEW_TOKENS)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generate_matches_transformers(checkpoints, prompts, hf_greedy, arch, packed):
    pad_id = 127
    session = make_session(Engine.from_dir(checkpoints[arch][0], tokens_per_block=8))
    output = GenerationOutput()
    session.generate(output, generation_input(prompts, packed, NO_END_ID, pad_id), SamplingConfig())
    max_len = max(map(len, prompts)) + NUM_NEW_TOKENS
    assert output.ids.shape == (4, 1, max_len)
    assert output.lengths.flatten().tolist() == [len(p) + NUM_NEW_TOKENS for p in prompts]
    for i, p in enumerate(prompts):
        assert output.ids[i, 0, :len(p) + NUM_NEW_TOKENS].tolist() == p + hf_greedy[arch][i], f"sequence {i}"
        assert output.ids[i, 0, len(p) + NUM_NEW_TOKENS:].tolist() == [pad_id] * (max_len - len(p) - NUM_NEW_TOKENS)


def test_generate_stops_at_end_id(checkpoints, prompts, hf_greedy):
    generated = hf_greedy["llama"]
    # end_id: a token sequence 0 first generates at step k >= 4 (steps before it run normally).
    stop_step = next(k for k in range(4, NUM_NEW_TOKENS) if generated[0][k] not in generated[0][:k])
    end_id, pad_id = generated[0][stop_step], 127
    expected = [g[:g.index(end_id)] if end_id in g else g for g in generated]
    calls = []
    output = GenerationOutput(on_token_generated=lambda ids, step, done: calls.append((ids.clone(), step, done)))
    session = make_session(Engine.from_dir(checkpoints["llama"][0], tokens_per_block=8))
    session.generate(output, generation_input(prompts, True, end_id, pad_id), SamplingConfig())

    max_len = max(map(len, prompts)) + NUM_NEW_TOKENS
    assert output.lengths.flatten().tolist() == [len(p) + len(g) for p, g in zip(prompts, expected)]
    for i, (p, g) in enumerate(zip(prompts, expected)):
        assert output.ids[i, 0].tolist() == p + g + [pad_id] * (max_len - len(p) - len(g)), f"sequence {i}"
    # One call per step; every sequence's last step is the one that produced end_id or its last token.
    num_steps = max(len(g) + 1 if len(g) < NUM_NEW_TOKENS else NUM_NEW_TOKENS for g in expected)
    assert [step for _, step, _ in calls] == list(range(num_steps))
    assert [done for _, _, done in calls] == [False] * (num_steps - 1) + [True]
    ids_at_step_1 = calls[1][0]
    assert ids_at_step_1[0, 0, :len(prompts[0]) + 2].tolist() == prompts[0] + generated[0][:2]


@pytest.mark.parametrize("arch", ARCHS)
def test_generate_gathers_context_and_generation_logits(checkpoints, prompts, hf_greedy, arch):
    path, model = checkpoints[arch]
    engine = Engine.from_dir(path, tokens_per_block=8, gather_context_logits=True, gather_generation_logits=True)
    output = GenerationOutput()
    make_session(engine).generate(output, generation_input(prompts, False, NO_END_ID, 0), SamplingConfig())
    max_input_len = max(map(len, prompts))
    assert output.context_logits.shape == (4, max_input_len, 128)
    assert output.generation_logits.shape == (4, 1, NUM_NEW_TOKENS, 128)
    for i, p in enumerate(prompts):
        ref = hf_logits(model, p + hf_greedy[arch][i])
        torch.testing.assert_close(output.context_logits[i, :len(p)], ref[:len(p)], atol=ATOL, rtol=0)
        # Step s's logits are those of the sequence's last token before the step.
        torch.testing.assert_close(output.generation_logits[i, 0], ref[len(p) - 1:-1], atol=ATOL, rtol=0)


def test_generate_without_gather_flags_returns_no_logits(checkpoints, prompts):
    output = GenerationOutput()
    session = make_session(Engine.from_dir(checkpoints["gpt2"][0]))
    session.generate(output, generation_input(prompts, True, NO_END_ID, 0), SamplingConfig())
    assert output.context_logits is None and output.generation_logits is None


# --- half precision ---------------------------------------------------------------------------

# (dtype, max abs error, mean abs error) against the fp32 transformers logits (|logits| up to ~6).
HALF_TOLERANCES = [("float16", torch.float16, 5e-2, 1e-2), ("bfloat16", torch.bfloat16, 4e-1, 6e-2)]


@pytest.mark.parametrize("dtype_name,dtype,max_err,mean_err", HALF_TOLERANCES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_half_precision_close_to_fp32(checkpoints, arch, dtype_name, dtype, max_err, mean_err):
    path, model = checkpoints[arch]
    engine = Engine.from_dir(path, dtype=dtype_name, tokens_per_block=4)
    assert engine.build_config.dtype == dtype_name
    assert all(t.dtype == dtype for t in engine.weights.values())
    runner = ModelRunner(engine, num_blocks=16)
    assert runner.kv_pool.dtype == dtype
    tokens = random_tokens(30, seed=9)
    ref = hf_logits(model, tokens)
    context = run_prompt(runner, tokens[:-1], list(range(8)))
    generation = runner.forward(step_inputs([(tokens[-1:], 29, list(range(8)))]))["logits"]
    logits = torch.cat([context, generation])
    err = (logits - ref).abs()
    assert err.max() < max_err and err.mean() < mean_err, (err.max().item(), err.mean().item())
    assert err.max() > 0  # the engine really ran in reduced precision
    agree = (logits.argmax(-1) == ref.argmax(-1)).float().mean()
    assert agree >= 0.9, agree.item()


@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # gated and plain MLP
def test_mlp_in_row_chunks_matches_transformers(checkpoints, arch):
    path, model = checkpoints[arch]
    runner = ModelRunner(Engine.from_dir(path, tokens_per_block=4), num_blocks=16)
    assert runner.model.mlp_chunk_rows == 1024  # the CPU default
    runner.model.mlp_chunk_rows = 3  # a 13-token prompt: 5 chunks, the last one short
    tokens = random_tokens(13, seed=21)
    torch.testing.assert_close(run_prompt(runner, tokens, [0, 1, 2, 3]), hf_logits(model, tokens), atol=ATOL, rtol=0)
