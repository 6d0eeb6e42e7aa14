"""Guided decoding where nothing is allowed (API.md, "Beyond the seeds"): a masked-out token is
never sampled and bad_words are never emitted, guided or not. A guide that can never complete
(`start: "a" start`) or whose every first token is banned ends at that step with an error naming
guided_decoding_params and the step; a guide that matches no string (left recursion, a bare
self-referencing $ref, an empty regex language) is refused at admission, with or without an end
id; the end tokens are allowed only where the grammar is complete. GptManager and the Executor
on the torch backend, and a few requests through the CUDA sampler on emu."""
from __future__ import annotations

import json

import pytest
import torch

from batch_manager import GuidedDecodingConfig, GuideType, KvCacheConfig
from batch_manager import tensor_names as tn
from batch_manager.executor import Executor, ExecutorConfig, ModelType, Request, SamplingConfig
from batch_manager.guided_decoding import GuidedDecodingParams
from runtime.decoding.guided import bitmask_words
from tests.batch_manager.conftest import make_request
from tests.batch_manager.executor.helpers import collect
from tests.batch_manager.test_guided_decoding import EOS, guided_engine, guided_request, params, run  # noqa: F401

A_FOREVER = 'start: "a" start'        # "a", then llguidance's matcher can go no further
LEFT_RECURSIVE = 'start: start "a"'
SELF_REF = json.dumps({"$ref": "#"})
NESTED_FOREVER = json.dumps({"$ref": "#/$defs/a", "$defs": {"a": {
    "type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"], "additionalProperties": False}}})
EMPTY_REGEX = r"[^\x00-\U0010FFFF]"
VOCAB = 320


def compiler(tokenizer_dir):
    return GuidedDecodingConfig.from_tokenizer(tokenizer_dir).build_compiler(VOCAB)


def allowed_tokens(guide, end_id=None) -> list[int]:
    bitmask = torch.zeros(1, bitmask_words(VOCAB), dtype=torch.int32)
    guide.fill_bitmask(bitmask, 0, 0, end_id=end_id)
    return [t for t in range(VOCAB) if (int(bitmask[0, t // 32]) >> (t % 32)) & 1]


def bad_words(tokens: list[int]) -> torch.Tensor:
    """bad_words_list int32 [1, 2, n]: each token a one-token word."""
    return torch.tensor([[tokens, list(range(1, len(tokens) + 1))]], dtype=torch.int32)


def first_json_tokens(tokenizer_dir) -> list[int]:
    return allowed_tokens(compiler(tokenizer_dir).compile("json", None).result().start())


def error_of(client, request_id) -> str:
    responses = client.responses[request_id]
    assert len(responses) == 1 and responses[0][1] is True, responses   # one final response
    return responses[0][2]


SEEDS = [None, 3]   # greedy, then plain sampling from the masked distribution


def test_end_tokens_are_allowed_only_where_the_grammar_is_complete(guided_engine):
    _, tokenizer_dir, _ = guided_engine
    guide = compiler(tokenizer_dir).compile("regex", "ab?").result().start()
    assert EOS not in allowed_tokens(guide, end_id=7) and 7 not in allowed_tokens(guide, end_id=7)
    guide.consume(0, [allowed_tokens(guide)[0]])                  # "a": complete, "b" may follow
    after_a = allowed_tokens(guide, end_id=7)
    assert EOS in after_a and 7 in after_a and len(after_a) > 2
    forever = compiler(tokenizer_dir).compile("ebnf_grammar", A_FOREVER).result().start()
    first = allowed_tokens(forever, end_id=EOS)
    assert EOS not in first and len(first) >= 1
    forever.consume(0, [first[0]])
    assert allowed_tokens(forever, end_id=EOS) == []              # llguidance's error state: nothing


@pytest.mark.parametrize("seed", SEEDS)
def test_a_guide_that_cannot_go_on_ends_with_an_error_at_that_step(guided_engine, seed):
    engine_dir, tokenizer_dir, _ = guided_engine
    first = first_json_tokens(tokenizer_dir)
    requests = [guided_request(1, GuideType.EBNF_GRAMMAR, A_FOREVER, max_new_tokens=10, seed=seed),
                guided_request(2, GuideType.JSON, None, max_new_tokens=10, seed=seed, bad_words_list=bad_words(first)),
                guided_request(3, GuideType.REGEX, "[a-c]{3}", max_new_tokens=10, seed=seed),
                guided_request(4, GuideType.EBNF_GRAMMAR, A_FOREVER, max_new_tokens=10, beam_width=torch.tensor([[2]])),
                guided_request(5, GuideType.EBNF_GRAMMAR, A_FOREVER, max_new_tokens=10, seed=7,
                               num_return_sequences=torch.tensor([[2]], dtype=torch.int32))]
    client = run(engine_dir, requests, params(tokenizer_dir))
    for i in (1, 4, 5):   # one sequence, two beams, two samples
        assert error_of(client, i).startswith("guided_decoding_params: no token is allowed at generation step 1:")
    assert error_of(client, 2).startswith("guided_decoding_params: no token is allowed at generation step 0:")
    tensors, _, err = client.final(3)                                # the others are undisturbed
    assert err == "" and int(tensors[tn.SEQUENCE_LENGTH][0, 0]) == 3 + 3


@pytest.mark.parametrize("end_id", [EOS, None])
def test_a_guide_that_matches_no_string_is_refused_at_admission(guided_engine, end_id):
    engine_dir, tokenizer_dir, _ = guided_engine
    guides = {1: (GuideType.EBNF_GRAMMAR, LEFT_RECURSIVE), 2: (GuideType.JSON_SCHEMA, SELF_REF),
              3: (GuideType.REGEX, EMPTY_REGEX)}
    requests = [guided_request(i, *guide, max_new_tokens=8) for i, guide in guides.items()]
    for r in requests:
        if end_id is None:
            r.end_id = None
    client = run(engine_dir, requests, params(tokenizer_dir))
    for i, (guide_type, _) in guides.items():
        kind = {GuideType.EBNF_GRAMMAR: "ebnf_grammar", GuideType.JSON_SCHEMA: "json_schema",
                GuideType.REGEX: "regex"}[guide_type]
        assert error_of(client, i).startswith(f"guided_decoding_params.guide: the {kind} guide matches no string")


@pytest.mark.parametrize("seed", SEEDS)
def test_a_guide_that_never_completes_runs_to_length_on_allowed_tokens(guided_engine, seed):
    engine_dir, tokenizer_dir, _ = guided_engine
    client = run(engine_dir, [guided_request(1, GuideType.JSON_SCHEMA, NESTED_FOREVER, max_new_tokens=12, seed=seed)],
                 params(tokenizer_dir))
    tensors, _, err = client.final(1)
    assert err == "" and int(tensors[tn.SEQUENCE_LENGTH][0, 0]) == 3 + 12
    matcher = compiler(tokenizer_dir).compile("json_schema", NESTED_FOREVER).result().matcher.deep_copy()
    generated = tensors[tn.OUTPUT_IDS][0, 0, 3:15].tolist()
    assert matcher.try_consume_tokens(generated) == len(generated) and EOS not in generated


@pytest.mark.parametrize("seed", SEEDS)
def test_bad_words_are_never_emitted_and_banning_everything_is_an_error(guided_engine, seed):
    engine_dir, tokenizer_dir, _ = guided_engine
    sampled = {} if seed is None else dict(random_seed=torch.tensor([[seed]]), runtime_top_k=torch.tensor([[0]]))
    everything = make_request(1, [1, 40, 41], 6, bad_words_list=bad_words(list(range(VOCAB))), **sampled)
    all_but_two = make_request(2, [1, 40, 41], 6, end_id=torch.tensor([[EOS]], dtype=torch.int32),
                               bad_words_list=bad_words([t for t in range(VOCAB) if t not in (5, 6)]), **sampled)
    client = run(engine_dir, [everything, all_but_two], params(tokenizer_dir))
    assert error_of(client, 1).startswith("bad_words: no token is allowed at generation step 0:")
    tensors, _, err = client.final(2)
    assert err == "" and set(tensors[tn.OUTPUT_IDS][0, 0, 3:9].tolist()) <= {5, 6}


def test_executor_reports_the_step_with_no_token_allowed(guided_engine):
    engine_dir, tokenizer_dir, _ = guided_engine
    config = ExecutorConfig(kv_cache_config=KvCacheConfig(max_tokens=4096),
                            guided_decoding_config=GuidedDecodingConfig.from_tokenizer(tokenizer_dir))
    first = first_json_tokens(tokenizer_dir)
    guide = lambda kind, text: GuidedDecodingParams(kind, text)   # noqa: E731
    with Executor(engine_dir, ModelType.DECODER_ONLY, config) as executor:
        ids = [executor.enqueue_request(Request([1, 40], max_tokens=8, end_id=EOS, sampling_config=sampling,
                                                guided_decoding_params=g, bad_words=words))
               for g, sampling, words in (
                   (guide(GuideType.EBNF_GRAMMAR, A_FOREVER), SamplingConfig(), None),
                   (guide(GuideType.JSON, None), SamplingConfig(seed=1, top_k=0, top_p=1.0), [[t] for t in first]),
                   (guide(GuideType.EBNF_GRAMMAR, LEFT_RECURSIVE), SamplingConfig(), None),
                   (guide(GuideType.REGEX, "[a-c]{3}"), SamplingConfig(seed=2, top_k=0, top_p=1.0), None))]
        responses = collect(executor, ids)
    finals = [responses[i][-1] for i in ids]
    assert finals[0].has_error() and finals[0].error_msg.startswith(
        "guided_decoding_params: no token is allowed at generation step 1:")
    assert finals[1].has_error() and finals[1].error_msg.startswith(
        "guided_decoding_params: no token is allowed at generation step 0:")
    assert finals[2].has_error() and "guided_decoding_params.guide: the ebnf_grammar guide matches no string" \
        in finals[2].error_msg
    assert not finals[3].has_error() and len(finals[3].result.output_token_ids[0]) == 2 + 3


@pytest.fixture(scope="module")
def emu_params(guided_engine):
    from runtime.kernels.cuda.emu_backend import compiler_available
    if not compiler_available():
        pytest.skip("emu kernels need a C++20 compiler (g++)")
    return params(guided_engine[1], kernel_backend="emu")


def test_the_cuda_sampler_on_emu_never_draws_a_masked_token(guided_engine, emu_params):
    """cuda_src/sampling.cu's greedy and sampler (on emu): the same ends as the torch backend."""
    engine_dir, tokenizer_dir, _ = guided_engine
    first = first_json_tokens(tokenizer_dir)
    requests = [guided_request(1, GuideType.EBNF_GRAMMAR, A_FOREVER, max_new_tokens=4),
                guided_request(2, GuideType.EBNF_GRAMMAR, A_FOREVER, max_new_tokens=4, seed=5),
                guided_request(3, GuideType.JSON, None, max_new_tokens=4, seed=6, bad_words_list=bad_words(first)),
                make_request(4, [1, 40, 41], 4, bad_words_list=bad_words(list(range(VOCAB))))]
    client = run(engine_dir, requests, emu_params)
    assert error_of(client, 1).startswith("guided_decoding_params: no token is allowed at generation step 1:")
    assert error_of(client, 2).startswith("guided_decoding_params: no token is allowed at generation step 1:")
    assert error_of(client, 3).startswith("guided_decoding_params: no token is allowed at generation step 0:")
    assert error_of(client, 4).startswith("bad_words: no token is allowed at generation step 0:")
