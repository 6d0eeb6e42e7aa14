"""Guided decoding (llguidance) with a byte-level BPE tokenizer trained here and a random-weight
model over its vocabulary: seeded sampled generations under bounded guides finish and parse or
match; an unbounded guide stopped at max_tokens ends with LENGTH on a valid prefix; the mask bans
exactly what the grammar bans; beams, drafts and the Executor; bad guides name the field."""
from __future__ import annotations

import json
import re

import pytest
import torch

from batch_manager import (DecodingConfig, GptManager, GuidedDecodingConfig, GuidedDecodingParams, GuideType,
                           KvCacheConfig, SchedulerPolicy, TrtGptModelOptionalParams, TrtGptModelType)
from batch_manager import tensor_names as tn
from batch_manager.executor import Executor, ExecutorConfig, ModelType, Request, SamplingConfig
from runtime import build_engine
from runtime.decoding.guided import bitmask_words
from runtime.kernels import get_kernels
from tests.batch_manager.conftest import Client, make_request
from tests.batch_manager.executor.helpers import collect
from tests.factories import make_checkpoint

EOS = 2
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "enum": ["alice", "bob"]},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
REGEX = r"[a-c]{3,6}-[0-9]{2}"


@pytest.fixture(scope="module")
def guided_engine(tmp_path_factory):
    """(engine dir, tokenizer dir, tokenizers.Tokenizer): a 300-token byte-level BPE and a tiny
    LLaMA over a 320-token vocabulary (ids past the tokenizer's are never allowed)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    root = tmp_path_factory.mktemp("guided")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(['{"name": "alice", "age": 30}', "abc-12 cab-99", "hello world"] * 10, trainer)
    tokenizer_dir = root / "tokenizer"
    tokenizer_dir.mkdir()
    tok.save(str(tokenizer_dir / "tokenizer.json"))
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    make_checkpoint(root / "hf", "llama", vocab_size=320)
    build_engine(root / "hf", root / "engine", tokens_per_block=8, max_batch_size=16, max_input_len=32,
                 max_seq_len=160, max_num_tokens=512)
    return str(root / "engine"), str(tokenizer_dir), tok


def params(tokenizer_dir, **extra) -> TrtGptModelOptionalParams:
    return TrtGptModelOptionalParams(kv_cache_config=KvCacheConfig(max_tokens=4096),
                                     guided_decoding_config=GuidedDecodingConfig.from_tokenizer(tokenizer_dir), **extra)


def guided_request(request_id, guide_type, guide, max_new_tokens=100, seed=None, **tensors):
    r = make_request(request_id, [1, 40, 41], max_new_tokens, end_id=torch.tensor([[EOS]], dtype=torch.int32),
                     **tensors)
    if seed is not None:
        r.random_seed = torch.tensor([[seed]], dtype=torch.int64)
        r.runtime_top_k = torch.tensor([[0]], dtype=torch.int32)
        r.runtime_top_p = torch.tensor([[1.0]])   # plain sampling from the masked distribution
    r.guided_decoding_params = GuidedDecodingParams(guide_type, guide)
    return r


def run(engine_dir, requests, optional):
    client = Client(requests)
    with GptManager(engine_dir, TrtGptModelType.InflightFusedBatching, 2, SchedulerPolicy.GUARANTEED_NO_EVICT,
                    *client.callbacks(), optional_params=optional):
        client.wait(120)
    return client


def text(client, request_id, tok, prompt_len=3) -> str:
    tensors, _, err = client.final(request_id)
    assert err == "", err
    return tok.decode(tensors[tn.OUTPUT_IDS][0, 0].tolist()[prompt_len:])


def check_schema(value) -> None:
    assert set(value) == {"name", "age"} and value["name"] in ("alice", "bob")
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 99


def test_bounded_guides_finish_and_parse(guided_engine):
    engine_dir, tokenizer_dir, tok = guided_engine
    requests = [guided_request(i, GuideType.JSON_SCHEMA, json.dumps(SCHEMA), seed=i) for i in range(12)]
    requests += [guided_request(100 + i, GuideType.REGEX, REGEX, seed=i) for i in range(12)]
    requests += [guided_request(200 + i, GuideType.JSON, None, seed=i, max_new_tokens=150) for i in range(4)]
    client = run(engine_dir, requests, params(tokenizer_dir))
    for i in range(12):
        check_schema(json.loads(text(client, i, tok)))
        assert re.fullmatch(REGEX, text(client, 100 + i, tok))
    for i in range(4):   # any JSON object: parses when it finished in time, else a valid prefix
        tensors, _, _ = client.final(200 + i)
        out = text(client, 200 + i, tok)
        if int(tensors[tn.SEQUENCE_LENGTH][0, 0]) - 3 < 150:
            assert isinstance(json.loads(out), dict)


def test_an_unbounded_guide_stopped_at_max_tokens_is_a_valid_prefix(guided_engine):
    engine_dir, tokenizer_dir, tok = guided_engine
    client = run(engine_dir, [guided_request(i, GuideType.REGEX, "[a-z]+( [a-z]+)*", max_new_tokens=6, seed=i)
                              for i in range(6)], params(tokenizer_dir))
    for i in range(6):
        tensors, _, _ = client.final(i)
        assert int(tensors[tn.SEQUENCE_LENGTH][0, 0]) == 3 + 6       # LENGTH: every token was allowed
        assert re.fullmatch("[a-z ]*", text(client, i, tok))


def test_the_mask_bans_exactly_what_the_grammar_bans(guided_engine):
    _, tokenizer_dir, _ = guided_engine
    compiler = GuidedDecodingConfig.from_tokenizer(tokenizer_dir).build_compiler(320)
    guide = compiler.compile("regex", REGEX).result().start()
    guide.consume(0, [])
    bitmask = torch.full((1, bitmask_words(320)), -1, dtype=torch.int32)
    guide.fill_bitmask(bitmask, 0, 0)
    logits = torch.randn(1, 320)
    get_kernels("torch").apply_token_bitmask(logits, torch.tensor([0]), bitmask)
    matcher = guide.matchers[0]
    for token in range(320):
        allowed = matcher.deep_copy().try_consume_tokens([token]) == 1
        assert bool(torch.isfinite(logits[0, token])) == allowed, token
    assert 0 < int(torch.isfinite(logits).sum()) < 320


def test_beams_and_drafts_keep_the_grammar(guided_engine):
    engine_dir, tokenizer_dir, tok = guided_engine
    greedy = [guided_request(i, GuideType.JSON_SCHEMA, json.dumps(SCHEMA)) for i in range(3)]
    plain = run(engine_dir, greedy, params(tokenizer_dir))
    drafted = run(engine_dir, [guided_request(i, GuideType.JSON_SCHEMA, json.dumps(SCHEMA)) for i in range(3)],
                  params(tokenizer_dir, max_draft_tokens=4,
                         decoding_config=DecodingConfig(prompt_lookup_max_batch_size=0, prompt_lookup_num_tokens=3, max_matching_ngram_size=1)))
    for i in range(3):
        assert text(drafted, i, tok) == text(plain, i, tok)
        check_schema(json.loads(text(plain, i, tok)))
    beams = run(engine_dir, [guided_request(9, GuideType.REGEX, REGEX, beam_width=torch.tensor([[2]]))],
                params(tokenizer_dir))
    tensors, _, err = beams.final(9)
    assert err == ""
    for b in range(2):
        n = int(tensors[tn.SEQUENCE_LENGTH][0, b])
        assert re.fullmatch(REGEX, tok.decode(tensors[tn.OUTPUT_IDS][0, b, 3:n].tolist()))


def test_executor_guided_requests(guided_engine):
    engine_dir, tokenizer_dir, tok = guided_engine
    config = ExecutorConfig(kv_cache_config=KvCacheConfig(max_tokens=4096),
                            guided_decoding_config=GuidedDecodingConfig.from_tokenizer(tokenizer_dir))
    with Executor(engine_dir, ModelType.DECODER_ONLY, config) as executor:
        ids = [executor.enqueue_request(Request([1, 40], max_tokens=80, end_id=EOS,
                                                sampling_config=SamplingConfig(seed=s, top_p=1.0, top_k=0),
                                                guided_decoding_params=GuidedDecodingParams(GuideType.REGEX, REGEX)))
               for s in range(4)]
        with pytest.raises(ValueError, match=r"guided_decoding_params\.guide: required for REGEX"):
            executor.enqueue_request(Request([1], max_tokens=4,
                                             guided_decoding_params=GuidedDecodingParams(GuideType.REGEX)))
        responses = collect(executor, ids)
    for rid in ids:
        (final,) = [r for r in responses[rid] if r.result.is_final]
        assert re.fullmatch(REGEX, tok.decode(final.result.output_token_ids[0][2:]))


def test_bad_guides_get_an_error_naming_the_field(guided_engine):
    engine_dir, tokenizer_dir, _ = guided_engine
    bad = [guided_request(1, GuideType.REGEX, "[0-9"), guided_request(2, GuideType.JSON_SCHEMA, "{not json"),
           guided_request(3, "yaml", "x"), guided_request(4, GuideType.REGEX, REGEX)]
    client = run(engine_dir, bad, params(tokenizer_dir))
    assert "guided_decoding_params.guide: cannot compile the regex guide" in client.final(1)[2]
    assert "guided_decoding_params.guide: cannot compile the json_schema guide" in client.final(2)[2]
    assert "guided_decoding_params.guide_type: 'yaml' is not a GuideType" in client.final(3)[2]
    assert client.final(4)[2] == ""
    no_config = run(engine_dir, [guided_request(5, GuideType.REGEX, REGEX)],
                    TrtGptModelOptionalParams(kv_cache_config=KvCacheConfig(max_tokens=4096)))
    assert "guided_decoding_params: the engine has no guided_decoding_config" in no_config.final(5)[2]
