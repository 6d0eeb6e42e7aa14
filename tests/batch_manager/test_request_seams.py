"""The manager's objects a request carries, held to the Protocols the request core types them by
(runtime/request/seams.py: the runtime never imports batch_manager), and the Executor's client id
checked as the uint64 RequestSpec.client_id says it is."""
from __future__ import annotations

import pytest
import torch

from batch_manager import PeftCacheManagerConfig
from batch_manager.adapters.adapter_weights import AdapterWeights
from batch_manager.adapters.peft_cache import AdapterRef
from batch_manager.executor.conversion import to_spec
from batch_manager.executor.disaggregated import KvSource
from batch_manager.executor.request import Request
from runtime.request import RequestError
from runtime.request.seams import AdapterCacheBounds, AdapterHandle, AdapterWeightClaims, KvSourceAddress
from tests.batch_manager.test_lora_validation import limits


@pytest.mark.parametrize("value, protocol", [
    (AdapterRef(7), AdapterHandle),
    (KvSource("127.0.0.1", 5555, 12345, 8), KvSourceAddress),
    (PeftCacheManagerConfig(), AdapterCacheBounds),
    (AdapterWeights(torch.float32), AdapterWeightClaims),
])
def test_the_manager_objects_fit_the_request_core_protocols(value, protocol):
    assert isinstance(value, protocol)
    assert not isinstance(object(), protocol)   # the check can fail


@pytest.mark.parametrize("client_id, message", [
    ("abc", "client_id: expected an integer, got 'abc'"),
    (1.5, "client_id: expected an integer, got 1.5"),
    (True, "client_id: expected an integer, got True"),
    (-1, "client_id: -1 outside [0, 18446744073709551615]"),
    (1 << 64, "client_id: 18446744073709551616 outside"),
])
def test_a_client_id_that_is_no_uint64_is_refused_naming_it(client_id, message):
    with pytest.raises(RequestError, match=message.replace("[", r"\[").replace("]", r"\]")):
        to_spec(Request([1, 2, 3], 4, client_id=client_id), limits(), True, {}, False)


def test_a_uint64_client_id_is_kept():
    assert to_spec(Request([1, 2, 3], 4, client_id=(1 << 64) - 1), limits(), True, {}, False)[0].client_id \
        == (1 << 64) - 1
    assert to_spec(Request([1, 2, 3], 4), limits(), True, {}, False)[0].client_id is None
