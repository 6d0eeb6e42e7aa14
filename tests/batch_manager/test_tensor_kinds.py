"""Tensors of the wrong kind (bool, complex, on the meta device) are a ValueError naming the field
on both front-ends, at admission and without a model: GptManager's tensors and the Executor's
Request agree."""
from __future__ import annotations

import pytest
import torch

from batch_manager.executor.conversion import to_spec as executor_request
from batch_manager.executor.request import ExternalDraftTokensConfig, PromptTuningConfig, Request
from batch_manager.legacy.admission import to_spec
from runtime.request import RequestError
from runtime.adapters.prompt_tuning import virtual_tokens
from tests.batch_manager.test_lora_validation import limits, request

TABLE = torch.randn(4, 64)
VOCAB_SIZE = torch.tensor([4], dtype=torch.int32)


def gpt_manager_error(**tensors) -> str:
    with pytest.raises(RequestError) as e:
        to_spec(request(**tensors), limits())
    return str(e.value)


def executor_error(request_: Request) -> str:
    with pytest.raises(RequestError) as e:
        executor_request(request_, limits(), True, {}, False)
    return str(e.value)


@pytest.mark.parametrize("ids, message", [
    (torch.tensor([True, True, False]), "got torch.bool"),
    (torch.tensor([1, 2, 3], dtype=torch.complex64), "got torch.complex64"),
    (torch.tensor([1, 2, 3]).to("meta"), "a tensor on the meta device"),
])
def test_prompt_tensors_of_the_wrong_kind_are_refused_by_both(ids, message):
    assert gpt_manager_error(input_ids=ids).startswith("input_ids: ")
    assert message in gpt_manager_error(input_ids=ids)
    assert executor_error(Request(ids, 4)).startswith("input_token_ids: ")
    assert message in executor_error(Request(ids, 4))


@pytest.mark.parametrize("table, message", [
    (TABLE.to(torch.complex64), "expected float32, float16 or bfloat16, got torch.complex64"),
    (TABLE.to("meta"), "a tensor on the meta device (no values), shape [4, 64]"),
])
def test_prompt_tables_of_the_wrong_kind_are_refused_by_both(table, message):
    assert f"prompt_embedding_table: {message}" in gpt_manager_error(prompt_embedding_table=table,
                                                                     prompt_vocab_size=VOCAB_SIZE)
    error = executor_error(Request([1, 2, 3], 4, prompt_tuning_config=PromptTuningConfig(table)))
    assert f"prompt_tuning_config.embedding_table: {message}" in error


def test_the_runtime_refuses_a_complex_prompt_table():
    inputs = {"prompt_embedding_table": TABLE.to(torch.complex64), "prompt_table_offsets": torch.tensor([0]),
              "prompt_vocab_sizes": torch.tensor([4])}
    with pytest.raises(ValueError, match="prompt_embedding_table: expected float32, float16 or bfloat16"):
        virtual_tokens(inputs, torch.tensor([128, 5]), torch.tensor([2]), 128, 64)


def test_meta_tensors_elsewhere_name_their_field():
    meta = torch.zeros(128).to("meta")
    assert gpt_manager_error(embedding_bias=meta).startswith("embedding_bias: a tensor on the meta device")
    assert gpt_manager_error(max_new_tokens=torch.tensor([[4]]).to("meta")).startswith(
        "request_output_len: a tensor on the meta device")
    assert executor_error(Request([1, 2, 3], 4, embedding_bias=meta)).startswith("embedding_bias: ")
    drafts = ExternalDraftTokensConfig([1, 2], logits=torch.zeros(2, 128).to("meta"))
    assert "on the meta device" in executor_error(Request([1, 2, 3], 4, external_draft_tokens_config=drafts))
