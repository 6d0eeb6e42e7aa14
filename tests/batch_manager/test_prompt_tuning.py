"""Prompt tuning against transformers fed `inputs_embeds` built from the same table: through
GptManager (mixed with ordinary requests, chunked contexts), the Executor and GptSession; block
reuse keys virtual tokens by their table."""
from __future__ import annotations

import json

import pytest
import torch

from batch_manager import GptManager, SchedulerPolicy, TrtGptModelOptionalParams, TrtGptModelType
from batch_manager.options import KvCacheConfig
from runtime import Engine, GenerationInput, GenerationOutput, GptSession, SamplingConfig, WorldConfig
from tests.batch_manager.conftest import Client, make_request
from tests.lora_helpers import prompt_embeds, teacher_forced_logits

NUM_NEW = 8
V = 128   # the tiny model's vocab


def table(seed: int, rows: int = 4, hidden: int = 64) -> torch.Tensor:
    return torch.randn(rows, hidden, generator=torch.Generator().manual_seed(seed))


# Virtual ids first (a soft prompt), then ordinary ones; the third also has one in the middle.
PROMPTS = [[V, V + 1, V + 2, V + 3, 5, 9, 17, 33, 2], [V + 3, V + 1, 40, 41, 42],
           [V, V + 1, V + 2, V + 3, 6, 7, V + 2, 8, 9, 10, 11, 12, 13]]


def tuned_request(request_id, prompt, t=None):
    tensors = {"return_generation_logits": torch.tensor([True])}
    if t is not None:
        tensors.update(prompt_embedding_table=t[None], prompt_vocab_size=torch.tensor([t.shape[0]], dtype=torch.int32))
    return make_request(request_id, prompt, NUM_NEW, **tensors)


def check(model, prompt, t, generated, logits):
    ref = teacher_forced_logits(model, prompt_embeds(model, prompt, t), generated)
    assert ref.argmax(-1).tolist() == generated
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)


def run(engine_dir, requests, arrival_calls=None, model_type=TrtGptModelType.InflightFusedBatching, **params):
    client = Client(requests, arrival_calls)
    with GptManager(engine_dir, model_type, 1, SchedulerPolicy.GUARANTEED_NO_EVICT, *client.callbacks(),
                    optional_params=TrtGptModelOptionalParams(**params)):
        client.wait(120)
    return client


def check_response(client, request_id, model, prompt, t):
    tensors, _, err = client.final(request_id)
    assert err == ""
    n = int(tensors["sequence_length"][0, 0])
    generated = tensors["output_ids"][0, 0, len(prompt):n].tolist()
    check(model, prompt, t, generated, tensors["generation_logits"][0, 0, :len(generated)])


@pytest.mark.parametrize("chunked", [False, True])
def test_gpt_manager_mixes_tuned_and_ordinary_requests(tiny_engine, chunked):
    engine_dir, model = tiny_engine
    tables = [table(1), table(2), table(1, rows=6)]
    requests = [tuned_request(i, p, t) for i, (p, t) in enumerate(zip(PROMPTS, tables))]
    requests.append(tuned_request(3, [5, 9, 17, 33, 2]))
    params = dict(enable_chunked_context=True, max_num_tokens=8) if chunked else {}
    client = run(engine_dir, requests, **params)
    for i, t in enumerate(tables):
        check_response(client, i, model, PROMPTS[i], t)
    check_response(client, 3, model, [5, 9, 17, 33, 2], None)


def test_block_reuse_keys_virtual_tokens_by_their_table(tiny_engine):
    """Same ids, table A, then table B (no sharing: its own outputs), then table A again (shares)."""
    engine_dir, model = tiny_engine
    prompt = PROMPTS[2]
    tables = [table(1, rows=6), table(2, rows=6), table(1, rows=6)]
    requests = [tuned_request(i, prompt, t) for i, t in enumerate(tables)]
    client = run(engine_dir, requests, arrival_calls=[0, 40, 80], kv_cache_config=KvCacheConfig(enable_block_reuse=True))
    for i, t in enumerate(tables):
        check_response(client, i, model, prompt, t)
    assert json.loads(client.stats[-1])["Reused KV cache blocks"] == 3   # the third request's 3 full blocks


@pytest.mark.parametrize("bad, message", [
    (dict(prompt_embedding_table=torch.zeros(1, 4, 64)), "prompt_vocab_size: missing"),
    (dict(prompt_vocab_size=torch.tensor([4], dtype=torch.int32)), "prompt_embedding_table: missing"),
    (dict(prompt_embedding_table=torch.zeros(1, 4, 63), prompt_vocab_size=torch.tensor([4], dtype=torch.int32)),
     "prompt_embedding_table: expected shape [T, 64]"),
    (dict(prompt_embedding_table=torch.zeros(1, 4, 64, dtype=torch.int32),
          prompt_vocab_size=torch.tensor([4], dtype=torch.int32)), "prompt_embedding_table: expected float32"),
    (dict(prompt_embedding_table=torch.zeros(1, 4, 64), prompt_vocab_size=torch.tensor([3], dtype=torch.int32)),
     "prompt_vocab_size: 3, but prompt_embedding_table has 4 rows"),
    (dict(prompt_embedding_table=torch.full((1, 4, 64), float("nan")), prompt_vocab_size=torch.tensor([4])),
     "prompt_embedding_table: must be finite"),
    (dict(prompt_embedding_table=torch.zeros(4, 64, dtype=torch.complex64), prompt_vocab_size=torch.tensor([4])),
     "prompt_embedding_table: expected float32, float16 or bfloat16, got torch.complex64"),
    (dict(prompt_embedding_table=torch.zeros(4, 64).to("meta"), prompt_vocab_size=torch.tensor([4])),
     "prompt_embedding_table: a tensor on the meta device"),
])
def test_bad_prompt_tuning_tensors_are_refused(tiny_engine, bad, message):
    engine_dir, _ = tiny_engine
    client = run(engine_dir, [make_request(0, [V, 5, 6], NUM_NEW, **bad), make_request(1, [V + 4, 5], NUM_NEW,
                 prompt_embedding_table=torch.zeros(4, 64), prompt_vocab_size=torch.tensor([4]))])
    assert message in client.final(0)[2]
    assert "input_ids: token id 132 outside [0, 128 + 4 prompt table rows)" in client.final(1)[2]


def test_executor_prompt_tuning_config(tiny_engine):
    from batch_manager.executor import Executor, OutputConfig, PromptTuningConfig, Request
    engine_dir, model = tiny_engine
    t = table(3)
    output = OutputConfig(return_generation_logits=True, exclude_input_from_output=True)
    with Executor(engine_dir) as executor:
        ids = executor.enqueue_requests([Request(PROMPTS[0], NUM_NEW, output_config=output,
                                                 prompt_tuning_config=PromptTuningConfig(t)),
                                         Request([5, 6, 7], NUM_NEW, output_config=output)])
        with pytest.raises(ValueError, match=r"input_token_ids: token id 131 outside \[0, 128\)"):
            executor.enqueue_request(Request(PROMPTS[0], NUM_NEW))
        with pytest.raises(ValueError, match="prompt_tuning_config.embedding_table: expected shape"):
            executor.enqueue_request(Request(PROMPTS[0], NUM_NEW, prompt_tuning_config=PromptTuningConfig(t[:, :8])))
        for request_id, prompt, tt in zip(ids, (PROMPTS[0], [5, 6, 7]), (t, None)):
            responses = []
            while not responses or not responses[-1].result.is_final:
                responses += executor.await_responses(request_id)
            result = responses[-1].result
            check(model, prompt, tt, result.output_token_ids[0], result.generation_logits[0])


def test_gpt_session_prompt_tables_per_sequence(tiny_engine):
    engine_dir, model = tiny_engine
    engine = Engine.from_dir(engine_dir)
    session = GptSession(GptSession.Config(max_batch_size=2, max_beam_width=1, max_sequence_length=64),
                         engine.model_config, WorldConfig(), engine)
    prompts = [PROMPTS[0], PROMPTS[1] + [0] * 4]
    tables = torch.stack([table(4), table(5)])
    inp = GenerationInput(end_id=-1, pad_id=0, ids=torch.tensor(prompts, dtype=torch.int32),
                          lengths=torch.tensor([len(PROMPTS[0]), len(PROMPTS[1])], dtype=torch.int32),
                          prompt_embedding_table=tables)
    inp.max_new_tokens = NUM_NEW
    out = GenerationOutput()
    session.generate(out, inp, SamplingConfig(beam_width=1))
    for i, prompt in enumerate((PROMPTS[0], PROMPTS[1])):
        generated = out.ids[i, 0, len(prompt):len(prompt) + NUM_NEW].tolist()
        ref = teacher_forced_logits(model, prompt_embeds(model, prompt, tables[i]), generated)
        assert ref.argmax(-1).tolist() == generated
    with pytest.raises(ValueError, match=r"GenerationInput.ids: token id 1\d\d outside \[0, 128\)"):
        session.generate(GenerationOutput(), GenerationInput(-1, 0, torch.tensor([PROMPTS[0]], dtype=torch.int32),
                                                             torch.tensor([9], dtype=torch.int32), max_new_tokens=2),
                         SamplingConfig())
