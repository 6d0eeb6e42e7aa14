"""GPT-J, GPT-NeoX, BLOOM, Falcon (7B style, new decoder architecture with two norms or one,
sequential), Phi, Phi-3 and Qwen3 against transformers on tiny random checkpoints (fp32): config mapping
and weight tables, a packed mixed step's logits, greedy GptSession and GptManager tokens equal to
`generate`, incremental and chunked decoding over shuffled paged blocks equal to a one-shot step,
fp16 / bf16 engines and checkpoints, and the config options that are refused by name."""
from __future__ import annotations

import json

import pytest
import torch

from batch_manager import (GptManager, KvCacheConfig, SchedulerPolicy, TrtGptModelOptionalParams, TrtGptModelType,
                           tensor_names)
from runtime import ConfigError, Engine, GenerationOutput, ModelRunner, SamplingConfig, build_engine
from runtime.models import lookup, lookup_hf, model_config_from_hf
from runtime.loading.weights import expected_shapes
from tests.batch_manager.conftest import Client, make_request
from tests.factories import step_inputs
from tests.runtime.arch_factories import CASES, make_checkpoint
from tests.runtime.test_model_parity import (ATOL, HALF_TOLERANCES, NO_END_ID, NUM_NEW_TOKENS, generation_input,
                                             hf_logits, make_session, random_tokens, run_prompt)
from tests.runtime.test_paged_cache import one_shot_logits, shuffled_block_tables

# case -> the ModelConfig fields its factory config maps to
EXPECTED = {
    "gptj": dict(architecture="gptj", residual="parallel_shared_norm", rotary_style="interleaved",
                 rotary_fraction=0.5, num_kv_heads=4, qkv_bias=False, mlp_bias=True, lm_head_bias=True,
                 tie_word_embeddings=False),
    "gpt_neox": dict(architecture="gpt_neox", residual="parallel", rotary_style="neox", rotary_fraction=0.25,
                     qkv_bias=True, tie_word_embeddings=False),
    "gpt_neox_sequential": dict(architecture="gpt_neox", residual="sequential", rotary_fraction=0.5,
                                tie_word_embeddings=True),
    "bloom": dict(architecture="bloom", position_embedding="alibi", rope=None, embedding_norm=True,
                  residual="sequential", tie_word_embeddings=True),
    "bloom_6_heads": dict(architecture="bloom", position_embedding="alibi", num_heads=6, head_dim=16,
                          tie_word_embeddings=False),
    "falcon_7b": dict(architecture="falcon", residual="parallel_shared_norm", num_kv_heads=1, qkv_bias=False,
                      mlp_bias=False, tie_word_embeddings=True),
    "falcon_new_decoder": dict(architecture="falcon", residual="parallel", num_kv_heads=2, qkv_bias=True,
                               tie_word_embeddings=False),
    "falcon_new_decoder_one_norm": dict(architecture="falcon", residual="parallel_shared_norm", num_kv_heads=1,
                                        tie_word_embeddings=True),
    "falcon_sequential": dict(architecture="falcon", residual="sequential", num_kv_heads=4, out_bias=True),
    "phi": dict(architecture="phi", residual="parallel_shared_norm", rotary_fraction=0.5, lm_head_bias=True,
                norm_type="layernorm"),
    "phi3": dict(architecture="phi3", residual="sequential", norm_type="rmsnorm", mlp_type="gated",
                 rotary_fraction=0.5, num_kv_heads=2, sliding_window=8),
    "qwen3": dict(architecture="qwen3", qk_norm=True, qkv_bias=False, num_kv_heads=2, sliding_window=None,
                  tie_word_embeddings=False),
}
PROMPT_LENGTHS = (5, 13, 1, 9)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """case -> (checkpoint dir, transformers model with the same weights)."""
    out = {}
    for seed, case in enumerate(CASES):
        path = tmp_path_factory.mktemp(case)
        out[case] = (path, make_checkpoint(path, case, seed=seed))
    return out


@pytest.fixture(scope="module")
def prompts():
    return [random_tokens(n, seed=200 + n) for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def hf_greedy(checkpoints, prompts):
    """case -> transformers' greedy continuation (NUM_NEW_TOKENS tokens, no eos) of each prompt."""
    out = {}
    for case, (_, model) in checkpoints.items():
        out[case] = [model.generate(torch.tensor([p]), max_new_tokens=NUM_NEW_TOKENS, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
        assert all(len(tokens) == NUM_NEW_TOKENS for tokens in out[case])
    return out


def test_every_case_has_its_expectations_and_every_new_entry_a_case():
    assert set(EXPECTED) == set(CASES)
    assert {fields["architecture"] for fields in EXPECTED.values()} == {"gptj", "gpt_neox", "bloom", "falcon",
                                                                        "phi", "phi3", "qwen3"}


@pytest.mark.parametrize("case", CASES)
def test_config_mapping_and_weight_table(checkpoints, case):
    path, model = checkpoints[case]
    hf = json.loads((path / "config.json").read_text())
    cfg = model_config_from_hf(hf)
    entry = lookup_hf(hf)
    assert entry is lookup(cfg.architecture)
    assert {name: getattr(cfg, name) for name in EXPECTED[case]} == EXPECTED[case]
    assert (cfg.vocab_size, cfg.num_layers, cfg.head_dim, cfg.hidden_size // cfg.num_heads) == (128, 2, 16, 16)
    assert cfg.intermediate_size == (4 * cfg.hidden_size if cfg.architecture == "bloom" else 96)
    assert {name: getattr(cfg, name) for name in entry.variant} == dict(entry.variant)
    engine = Engine.from_dir(path)
    assert engine.model_config == cfg
    assert {name: tuple(t.shape) for name, t in engine.weights.items()} == expected_shapes(cfg)
    assert ("lm_head" in engine.weights) == (not model.config.tie_word_embeddings)
    torch.testing.assert_close(engine.weights["embed_tokens"], model.get_input_embeddings().weight, atol=0, rtol=0)


@pytest.mark.parametrize("case", CASES)
def test_packed_mixed_step_matches_transformers(checkpoints, case):
    path, model = checkpoints[case]
    runner = ModelRunner(Engine.from_dir(path, tokens_per_block=4), num_blocks=64)
    fresh = [random_tokens(n, seed=n) for n in (3, 11, 20)]
    cached = [random_tokens(n, seed=50 + n) for n in (8, 17)]  # the last token is the generation input
    chunked = random_tokens(14, seed=7)                         # 6 cached, 8 new in the mixed step
    blocks = {name: list(range(8 * i, 8 * i + 8)) for i, name in enumerate("abcdef")}
    runner.forward(step_inputs([(cached[0][:-1], 0, blocks["d"]), (cached[1][:-1], 0, blocks["e"]),
                                (chunked[:6], 0, blocks["f"])]))
    seqs = [(fresh[0], 0, blocks["a"]), (cached[0][-1:], 7, blocks["d"]), (fresh[1], 0, blocks["b"]),
            (chunked[6:], 6, blocks["f"]), (cached[1][-1:], 16, blocks["e"]), (fresh[2], 0, blocks["c"])]
    full_tokens = [fresh[0], cached[0], fresh[1], chunked, cached[1], fresh[2]]
    out = runner.forward(step_inputs(seqs, context_logits=True))
    offset = 0
    for i, ((new, past, _), tokens) in enumerate(zip(seqs, full_tokens)):
        ref = hf_logits(model, tokens)
        torch.testing.assert_close(out["logits"][i], ref[-1], atol=ATOL, rtol=0, msg=f"sequence {i}")
        torch.testing.assert_close(out["context_logits"][offset:offset + len(new)], ref[past:], atol=ATOL, rtol=0)
        offset += len(new)


@pytest.mark.parametrize("case", CASES)
def test_greedy_session_matches_generate(checkpoints, prompts, hf_greedy, case):
    session = make_session(Engine.from_dir(checkpoints[case][0], tokens_per_block=8))
    output = GenerationOutput()
    session.generate(output, generation_input(prompts, True, NO_END_ID, 127), SamplingConfig())
    for i, p in enumerate(prompts):
        assert output.ids[i, 0, :len(p) + NUM_NEW_TOKENS].tolist() == p + hf_greedy[case][i], f"sequence {i}"


@pytest.mark.parametrize("case", CASES)
def test_gpt_manager_from_an_engine_dir_matches_generate(checkpoints, prompts, hf_greedy, tmp_path, case):
    build_engine(checkpoints[case][0], tmp_path, tokens_per_block=4, max_batch_size=4, max_input_len=16,
                 max_seq_len=64, max_num_tokens=64)
    client = Client([make_request(i, p, max_new_tokens=NUM_NEW_TOKENS) for i, p in enumerate(prompts)],
                    [0, 0, 3, 5])
    params = TrtGptModelOptionalParams(kv_cache_config=KvCacheConfig(max_tokens=256))
    with GptManager(str(tmp_path), TrtGptModelType.InflightFusedBatching, 1, SchedulerPolicy.GUARANTEED_NO_EVICT,
                    *client.callbacks(), optional_params=params):
        client.wait(120)
    for i, p in enumerate(prompts):
        tensors, _, err = client.final(i)
        assert err == ""
        assert tensors[tensor_names.OUTPUT_IDS][0, 0].tolist() == p + hf_greedy[case][i], f"request {i}"


@pytest.mark.parametrize("case", CASES)
def test_incremental_decoding_over_shuffled_blocks_equals_one_shot(checkpoints, case):
    engine = Engine.from_dir(checkpoints[case][0], tokens_per_block=4)
    num_steps = 12
    prompts = [random_tokens(n, seed=n) for n in (5, 9, 2)]
    continuations = [random_tokens(num_steps, seed=100 + i) for i in range(3)]
    references = [one_shot_logits(engine, p + c) for p, c in zip(prompts, continuations)]
    tables = shuffled_block_tables(3 * 6 + 5, 6, 3, seed=len(case))
    runner = ModelRunner(engine, 3 * 6 + 5)
    logits = runner.forward(step_inputs([(p, 0, t) for p, t in zip(prompts, tables)]))["logits"]
    for step in range(num_steps + 1):
        for i, p in enumerate(prompts):
            torch.testing.assert_close(logits[i], references[i][len(p) - 1 + step], atol=ATOL, rtol=0,
                                       msg=f"sequence {i} step {step}")
        if step < num_steps:
            seqs = [([c[step]], len(p) + step, t) for p, c, t in zip(prompts, continuations, tables)]
            logits = runner.forward(step_inputs(seqs))["logits"]


@pytest.mark.parametrize("case", CASES)
def test_chunked_context_equals_one_shot(checkpoints, case):
    engine = Engine.from_dir(checkpoints[case][0], tokens_per_block=4)
    tokens = random_tokens(25, seed=3)
    reference = one_shot_logits(engine, tokens)
    table = shuffled_block_tables(9, 7, 1, seed=4)[0]
    runner = ModelRunner(engine, 9)
    past = 0
    for n in (10, 1, 6, 8):
        out = runner.forward(step_inputs([(tokens[past:past + n], past, table)], context_logits=True))
        torch.testing.assert_close(out["context_logits"], reference[past:past + n], atol=ATOL, rtol=0)
        past += n


@pytest.mark.parametrize("dtype_name,dtype,max_err,mean_err", HALF_TOLERANCES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", CASES)
def test_half_precision_engines_close_to_fp32(checkpoints, case, dtype_name, dtype, max_err, mean_err):
    path, model = checkpoints[case]
    engine = Engine.from_dir(path, dtype=dtype_name, tokens_per_block=4)
    assert all(t.dtype == dtype for t in engine.weights.values())
    runner = ModelRunner(engine, num_blocks=16)
    tokens = random_tokens(30, seed=9)
    ref = hf_logits(model, tokens)
    context = run_prompt(runner, tokens[:-1], list(range(8)))
    generation = runner.forward(step_inputs([(tokens[-1:], 29, list(range(8)))]))["logits"]
    err = (torch.cat([context, generation]) - ref).abs()
    assert 0 < err.max() < max_err and err.mean() < mean_err, (err.max().item(), err.mean().item())


@pytest.mark.parametrize("case", ["gptj", "bloom", "falcon_new_decoder", "phi"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_checkpoints_load(tmp_path, case, dtype):
    """A checkpoint saved in fp16 / bf16 serves in float32 with exactly its values (the reference:
    transformers loading the same files in float32)."""
    import transformers
    make_checkpoint(tmp_path, case, seed=5, dtype=dtype)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == str(dtype).removeprefix("torch.")
    engine = Engine.from_dir(tmp_path)
    assert engine.dtype == torch.float32
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    tokens = random_tokens(12, seed=5)
    torch.testing.assert_close(run_prompt(ModelRunner(engine, 4), tokens, [0, 1, 2]), hf_logits(model, tokens),
                               atol=ATOL, rtol=0)


# case -> config.json edit -> the error naming the field
REFUSED = [
    ("falcon_7b", {"alibi": True}, "alibi=true .*Falcon RW.* is not supported"),
    ("falcon_new_decoder", {"num_ln_in_parallel_attn": 3}, "num_ln_in_parallel_attn=3"),
    ("bloom", {"apply_residual_connection_post_layernorm": True},
     "apply_residual_connection_post_layernorm=true is not supported"),
    ("phi", {"qk_layernorm": True}, "qk_layernorm=true is not supported"),
    ("gptj", {"rotary_dim": None}, "missing field 'rotary_dim'"),
    ("gptj", {"rotary_dim": 20}, r"rotary_fraction: must be in \(0, 1\]"),
    ("gpt_neox", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.1}},
     "rotary_fraction: .*even number"),
    ("gpt_neox", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.5}},
     r"rope_parameters.partial_rotary_factor must be in \(0, 1\], got 1.5"),
    ("phi3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 4}},
     "rope_scaling: unsupported type 'longrope'"),
]


@pytest.mark.parametrize("case,edit,message", REFUSED)
def test_unsupported_options_are_refused_by_name(checkpoints, case, edit, message):
    hf = json.loads((checkpoints[case][0] / "config.json").read_text())
    hf.update(edit)
    with pytest.raises(ConfigError, match=message):
        model_config_from_hf(hf)


def test_legacy_neox_and_phi_fields_read_like_rope_parameters(checkpoints):
    """transformers 4 wrote GPT-NeoX's rotary_pct / rotary_emb_base and Phi's partial_rotary_factor /
    rope_theta at the top level."""
    for case, legacy in (("gpt_neox", {"rotary_pct": 0.25, "rotary_emb_base": 10000}),
                         ("phi", {"partial_rotary_factor": 0.5, "rope_theta": 10000.0})):
        hf = json.loads((checkpoints[case][0] / "config.json").read_text())
        new_style = model_config_from_hf(hf)
        del hf["rope_parameters"]
        assert model_config_from_hf({**hf, **legacy}) == new_style
