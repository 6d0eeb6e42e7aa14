"""Draft tokens through the Executor: ExternalDraftTokensConfig and the prompt-lookup drafter
give the tokens plain greedy decoding gives; bad drafts are refused at enqueue naming the field."""
from __future__ import annotations

import pytest

from batch_manager.executor import (DecodingConfig, Executor, ExecutorConfig, ExternalDraftTokensConfig, KvCacheConfig,
                                    ModelType, OutputConfig, Request, SamplingConfig)
from tests.batch_manager.conftest import NUM_NEW_TOKENS
from tests.batch_manager.executor.helpers import collect, final_tokens


def config(**overrides) -> ExecutorConfig:
    values = dict(kv_cache_config=KvCacheConfig(max_tokens=400, enable_block_reuse=True), max_draft_tokens=4,
                  decoding_config=DecodingConfig(prompt_lookup_max_batch_size=0, prompt_lookup_num_tokens=3, max_matching_ngram_size=2),
                  iter_stats_max_iterations=100)
    values.update(overrides)
    return ExecutorConfig(**values)


@pytest.mark.parametrize("streaming", [False, True])
def test_external_drafts_and_prompt_lookup_give_greedy_tokens(tiny_engine, prompts, references, streaming):
    engine_dir, _ = tiny_engine
    ids = list(prompts)[:8]
    with Executor(engine_dir, ModelType.DECODER_ONLY, config()) as executor:
        request_ids = {}
        for i in ids:
            truth = references[i][len(prompts[i]):len(prompts[i]) + 4]
            drafts = truth if i % 2 else [(t + 3) % 128 for t in truth]
            request_ids[executor.enqueue_request(Request(
                prompts[i], max_tokens=NUM_NEW_TOKENS, streaming=streaming,
                output_config=OutputConfig(exclude_input_from_output=True),
                external_draft_tokens_config=ExternalDraftTokensConfig(drafts)))] = i
        responses = collect(executor, list(request_ids))
        stats = executor.get_latest_iteration_stats()
    for rid, i in request_ids.items():
        assert final_tokens(responses[rid], streaming) == [references[i][len(prompts[i]):]], f"request {i}"
    last = stats[-1]
    assert 0 < last.num_draft_tokens_accepted <= last.num_draft_tokens_proposed
    assert '"Draft Tokens Accepted"' in last.to_json_str()


@pytest.mark.parametrize("drafts, message", [
    (ExternalDraftTokensConfig([1, 2, 3, 4, 5]), "external_draft_tokens_config.tokens: 5 draft tokens exceed"),
    (ExternalDraftTokensConfig([1, 999]), "external_draft_tokens_config.tokens: token ids must be in [0, 128)"),
    (ExternalDraftTokensConfig([1, 2], logits="x"), "external_draft_tokens_config.logits: expected a float tensor"),
    (ExternalDraftTokensConfig([1, 2], acceptance_threshold=-1.0),
     "external_draft_tokens_config.acceptance_threshold: must be a finite number >= 0"),
    ("drafts", "external_draft_tokens_config: expected an ExternalDraftTokensConfig"),
])
def test_bad_drafts_are_refused_at_enqueue(tiny_engine, prompts, drafts, message):
    with Executor(tiny_engine[0], ModelType.DECODER_ONLY, config()) as executor:
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
            executor.enqueue_request(Request(prompts[0], max_tokens=4, external_draft_tokens_config=drafts))


def test_drafts_with_beams_are_refused(tiny_engine, prompts):
    with Executor(tiny_engine[0], ModelType.DECODER_ONLY, config(max_beam_width=2)) as executor:
        with pytest.raises(ValueError, match="external_draft_tokens_config: draft tokens need beam width 1, got 2"):
            executor.enqueue_request(Request(prompts[0], max_tokens=4, sampling_config=SamplingConfig(beam_width=2),
                                             external_draft_tokens_config=ExternalDraftTokensConfig([1])))
