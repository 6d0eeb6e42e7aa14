"""Which weights a LoRA task id names (batch_manager.adapters.adapter_weights) and the PEFT cache's check of
weights sent again: a repeat (identical in the cache's dtype, padding aside) is accepted, other
weights are refused while the id is cached or claimed by a queued request, and an evicted id may
take new weights. No model: real adapters converted for the tiny LLaMA's config."""
from __future__ import annotations

import gc

import torch

from batch_manager.adapters.adapter_weights import AdapterWeights
from batch_manager.adapters.peft_cache import AdapterRef, PeftCache
from runtime.adapters.lora import adapter_from_tensors
from runtime.models import model_config_from_hf
from tests.factories import hf_config

CFG = model_config_from_hf(hf_config("llama").to_dict())
ROWS = [(1, 0, 4), (3, 1, 2)]          # attn_q of layer 0 (rank 4), attn_v of layer 1 (rank 2)
WIDTH = 4 * (64 + 64)                  # the longest row: attn_q of rank 4 in a hidden size of 64


def tensors(seed: int = 0, width: int = WIDTH, dtype=torch.float32):
    weights = torch.randn(len(ROWS), width, generator=torch.Generator().manual_seed(seed)).to(dtype)
    weights[1, 2 * (64 + 32):] = 0                            # the shorter row's padding
    return weights, torch.tensor(ROWS, dtype=torch.int32)


def ref(task_id: int, weights_and_config) -> AdapterRef:
    return AdapterRef(task_id, adapter_from_tensors(*weights_and_config, CFG, 64), 10, 2)


def test_the_digest_compares_the_weights_in_the_caches_dtype():
    fp32, bf16 = AdapterWeights(torch.float32), AdapterWeights(torch.bfloat16)
    w, c = tensors()
    padded = (torch.cat([w, torch.zeros(2, 8)], dim=1), c)            # longer zero padding: the same adapter
    rounded = (w.to(torch.bfloat16), c)                                # equal once in bfloat16
    for record in (fp32, bf16):
        assert record.digest(ref(1, (w, c)).payload) == record.digest(ref(1, padded).payload)
        assert record.digest(ref(1, (w, c)).payload) != record.digest(ref(1, tensors(seed=1)).payload)
    assert bf16.digest(ref(1, (w, c)).payload) == bf16.digest(ref(1, rounded).payload)
    assert fp32.digest(ref(1, (w, c)).payload) != fp32.digest(ref(1, rounded).payload)


def cache(host_capacity: int = 100) -> PeftCache:
    c = PeftCache(host_capacity, 8)
    c.weights = AdapterWeights(torch.float32)
    return c


def test_a_cached_id_takes_the_same_weights_again_and_refuses_others():
    c = cache()
    assert c.register(ref(1, tensors())) is None
    instance = c.instance(1)
    assert c.register(ref(1, tensors())) is None                   # a repeat: not reloaded
    assert c.register(AdapterRef(1)) is None                       # the id alone
    assert c.register(ref(1, tensors(seed=1))) == (
        "lora_weights: task id 1 is cached with other weights; a cached id is never served with other weights "
        "(send the new adapter under a new task id)")
    assert c.instance(1) == instance and c.num_cached == 1
    c.check_invariants()


def test_an_evicted_id_takes_new_weights():
    c = cache(host_capacity=10)                                    # room for one adapter
    assert c.register(ref(1, tensors())) is None
    c.unregister(1)
    assert c.register(ref(2, tensors(seed=2))) is None             # idle 1 leaves the host cache
    assert not c.is_cached(1)
    assert c.register(ref(1, tensors(seed=1))) is None             # new weights under the freed id
    c.check_invariants()
    assert c.weights.claim(ref(1, tensors()), "w") is not None       # ... and they are what 1 names now


def test_a_claim_holds_the_id_until_its_request_is_registered_or_dropped():
    c = cache()
    weights = c.weights
    first = ref(7, tensors())
    assert weights.claim(first, "lora_config.weights") is None
    assert weights.claim(ref(7, tensors()), "lora_config.weights") is None   # the same weights: fine
    error = weights.claim(ref(7, tensors(seed=1)), "lora_config.weights")
    assert error.startswith("lora_config.weights: task id 7 was sent with other weights by a request still queued")
    assert c.register(first) is None                               # cached now: the claim became the record
    error = weights.claim(ref(7, tensors(seed=1)), "lora_config.weights")
    assert error.startswith("lora_config.weights: task id 7 is cached with other weights")
    dropped = ref(8, tensors())
    assert weights.claim(dropped, "lora_config.weights") is None
    del dropped                                                    # a cancelled queued request
    gc.collect()
    assert weights.claim(ref(8, tensors(seed=1)), "lora_config.weights") is None
    c.check_invariants()


def test_a_refused_adapter_ends_its_claim():
    c = PeftCache(100, 1)
    c.weights = AdapterWeights(torch.float32)
    big = AdapterRef(3, ref(3, tensors()).payload, 10, 2)         # 2 rows > the device cache's 1
    assert c.weights.claim(big, "w") is None
    assert "needs 2 device cache rows" in c.register(big)
    assert c.weights.claim(ref(3, tensors(seed=1)), "w") is None
    c.check_invariants()
