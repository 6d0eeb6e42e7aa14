"""Every LoRA request error names the field and the value (GptManager tensors and the Executor's
LoraConfig), checked at admission without a model."""
from __future__ import annotations

import pytest
import torch

from batch_manager import InferenceRequest
from batch_manager.executor.conversion import to_spec as executor_request
from batch_manager.executor.request import LoraConfig, Request
from batch_manager import PeftCacheManagerConfig
from batch_manager.legacy.admission import to_spec
from runtime.request import AdmissionLimits, RequestError
from runtime.config import ModelConfig
from runtime.models import model_config_from_hf
from tests.factories import hf_config

H, Q, KV, I = 64, 64, 32, 96   # the tiny LLaMA: 4 heads of 16, 2 KV heads, intermediate 96


def limits(arch: str = "llama", max_adapter_size: int = 64) -> AdmissionLimits:
    cfg: ModelConfig = model_config_from_hf(hf_config(arch).to_dict())
    return AdmissionLimits(vocab_size=cfg.vocab_size, max_input_len=48, max_seq_len=96, max_beam_width=1,
                           max_num_blocks=64, tokens_per_block=4, gather_context_logits=False,
                           gather_generation_logits=False, model_config=cfg,
                           peft_cache_config=PeftCacheManagerConfig(max_adapter_size=max_adapter_size))


def adapter(rows: list[tuple[int, int, int]], width: int | None = None, dtype=torch.float32):
    """[N, width] weights (random) and [N, 3] config for the rows; width defaults to what they need."""
    need = {0: H + Q + 2 * KV, 1: H + Q, 2: H + KV, 3: H + KV, 4: Q + H, 5: H + I, 6: I + H, 7: H + I}
    width = width or max(r * need[m] for m, _, r in rows)
    return torch.randn(len(rows), width).to(dtype), torch.tensor(rows, dtype=torch.int32)


def request(**tensors) -> InferenceRequest:
    r = InferenceRequest(1)
    r.input_ids = torch.tensor([1, 2, 3], dtype=torch.int32)
    r.max_new_tokens = torch.tensor([[4]], dtype=torch.int32)
    for name, value in tensors.items():
        setattr(r, name, value)
    return r


def task(task_id: int) -> torch.Tensor:
    return torch.tensor([task_id], dtype=torch.uint64)


def test_a_valid_adapter_becomes_an_adapter_ref():
    w, c = adapter([(1, 0, 4), (3, 1, 8), (7, 0, 2)])
    r = to_spec(request(lora_task_id=task(5), lora_weights=w[None], lora_config=c[None]), limits())
    assert r.lora.task_id == 5 and r.lora.payload.ranks == (4, 8, 2)
    assert r.lora.device_rows == 3 and r.lora.host_cost == (4 * (H + Q) + 8 * (H + KV) + 2 * (H + I)) * 4
    assert to_spec(request(lora_task_id=task(5)), limits()).lora.payload is None


@pytest.mark.parametrize("tensors, message", [
    (dict(lora_weights=adapter([(1, 0, 4)])[0], lora_config=adapter([(1, 0, 4)])[1]),
     "lora_weights / lora_config: given without lora_task_id"),
    (dict(lora_task_id=task(1), lora_weights=adapter([(1, 0, 4)])[0]), "lora_config: missing"),
    (dict(lora_task_id=task(1), lora_config=adapter([(1, 0, 4)])[1]), "lora_weights: missing"),
    (dict(lora_task_id=task(1 << 63)), "lora_task_id: expected an integer in [0, 2**63), got 9223372036854775808"),
    (dict(lora_task_id=torch.tensor([1.0])), "lora_task_id: expected one integer value"),
    (dict(lora_task_id=task(1), lora_weights=adapter([(9, 0, 4)], 512)[0], lora_config=adapter([(9, 0, 4)], 512)[1]),
     "lora_config: row 0 names module 9 (unknown)"),
    (dict(lora_task_id=task(1), lora_weights=adapter([(1, 2, 4)])[0], lora_config=adapter([(1, 2, 4)])[1]),
     "lora_config: row 0 names layer 2; the model has layers [0, 2)"),
    (dict(lora_task_id=task(1), lora_weights=adapter([(1, 0, 4)])[0], lora_config=torch.tensor([[1, 0, 0]])),
     "lora_config: row 0 has adapter size 0, outside [1, max_adapter_size=64]"),
    (dict(lora_task_id=task(1), lora_weights=adapter([(1, 0, 65)])[0], lora_config=adapter([(1, 0, 65)])[1]),
     "lora_config: row 0 has adapter size 65, outside [1, max_adapter_size=64]"),
    (dict(lora_task_id=task(1), lora_weights=adapter([(1, 0, 4), (6, 1, 4)], 4 * (H + Q))[0],
          lora_config=adapter([(1, 0, 4), (6, 1, 4)])[1]),
     f"lora_weights: row 1 has {4 * (H + Q)} values; mlp_4h_to_h of rank 4 needs 4 * ({I} + {H}) = {4 * (I + H)}"),
    (dict(lora_task_id=task(1), lora_weights=adapter([(1, 0, 4)], dtype=torch.int32)[0],
          lora_config=adapter([(1, 0, 4)])[1]), "lora_weights: expected float32, float16 or bfloat16, got torch.int32"),
    (dict(lora_task_id=task(1), lora_weights=adapter([(1, 0, 4)])[0], lora_config=torch.tensor([[1.0, 0, 4]])),
     "lora_config: expected an int32 tensor, got torch.float32"),
    (dict(lora_task_id=task(1), lora_weights=adapter([(1, 0, 4), (1, 0, 4)])[0],
          lora_config=adapter([(1, 0, 4), (1, 0, 4)])[1]), "lora_config: row 1 repeats module 1 (attn_q) of layer 0"),
    (dict(lora_task_id=task(1), lora_weights=torch.randn(2, 512),
          lora_config=adapter([(1, 0, 4)])[1]), "lora_weights: expected shape [1, W]"),
    (dict(lora_task_id=task(1), lora_weights=adapter([(1, 0, 4)])[0].fill_(float("inf")),
          lora_config=adapter([(1, 0, 4)])[1]), "lora_weights: must be finite"),
    (dict(lora_task_id=task(1), lora_weights=adapter([(1, 0, 4)])[0].to("meta"), lora_config=adapter([(1, 0, 4)])[1]),
     "lora_weights: a tensor on the meta device (no values), shape [1, 512]"),
    (dict(lora_task_id=task(1), lora_weights=adapter([(1, 0, 4)])[0], lora_config=adapter([(1, 0, 4)])[1].to("meta")),
     "lora_config: a tensor on the meta device (no values), shape [1, 3]"),
    (dict(lora_task_id=task(1).to("meta")), "lora_task_id: expected one integer value (uint64 [1]), got torch.uint64 "
                                            "[1] on the meta device"),
    (dict(lora_task_id=torch.tensor([1j])), "lora_task_id: expected one integer value (uint64 [1]), got "
                                            "torch.complex64 [1]"),
])
def test_bad_lora_tensors_name_the_field_and_value(tensors, message):
    with pytest.raises(RequestError) as e:
        to_spec(request(**tensors), limits())
    assert message in str(e.value)


def test_gpt2_has_no_mlp_gate_module():
    w, c = adapter([(7, 0, 4)])
    with pytest.raises(RequestError, match=r"lora_config: row 0 names module 7 \(mlp_gate\), which this gpt2 model"):
        to_spec(request(lora_task_id=task(1), lora_weights=w, lora_config=c), limits("gpt2"))


def test_max_adapter_size_comes_from_the_cache_config():
    w, c = adapter([(1, 0, 16)])
    with pytest.raises(RequestError, match="adapter size 16, outside \\[1, max_adapter_size=8\\]"):
        to_spec(request(lora_task_id=task(1), lora_weights=w, lora_config=c), limits(max_adapter_size=8))


def test_executor_lora_config_errors_name_its_fields():
    w, c = adapter([(1, 0, 4)])
    lim = limits()
    r, _ = executor_request(Request([1, 2, 3], 4, lora_config=LoraConfig(3, w, c)), lim, True, {}, False)
    assert r.lora.task_id == 3
    for config, message in [(LoraConfig(3, w), "lora_config.config: missing"),
                            (LoraConfig(-1), "lora_config.task_id: expected an integer in [0, 2**63), got -1"),
                            (LoraConfig(3, w, torch.tensor([[1, 5, 4]])), "lora_config.config: row 0 names layer 5"),
                            (LoraConfig(3, w.to("meta"), c), "lora_config.weights: a tensor on the meta device"),
                            (LoraConfig(3, w, c.to("meta")), "lora_config.config: a tensor on the meta device"),
                            ("task 3", "lora_config: expected a LoraConfig, got str")]:
        with pytest.raises(RequestError) as e:
            executor_request(Request([1, 2, 3], 4, lora_config=config), lim, True, {}, False)
        assert message in str(e.value)
