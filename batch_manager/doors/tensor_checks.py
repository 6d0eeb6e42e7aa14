"""The checks both tensor doors (GptManager's tensors, the Executor's `Request`) apply to what they
parse: the integer dtypes taken as token ids, draft logits made finite float32 rows, and the salt
that keys a request's cached KV by its adapter and prompt table."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from runtime.adapters.prompt_tuning import table_digest
from runtime.request import RequestError

if TYPE_CHECKING:
    from ..adapters.peft_cache import AdapterRef

INT_DTYPES = (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8, torch.uint32, torch.uint64)


def cache_salt(lora: AdapterRef | None, table) -> bytes | None:
    """What keys a request's cached KV besides its tokens: its adapter and its prompt table."""
    if lora is None and table is None:
        return None
    task = b"" if lora is None else lora.task_id.to_bytes(8, "little")
    return task + b"|" + (b"" if table is None else table_digest(table))


def finite_rows(name: str, logits: torch.Tensor) -> torch.Tensor:
    """Draft logits as the decoder takes them: float32 on the CPU, a copy, finite."""
    logits = logits.detach().to("cpu", torch.float32).clone()
    if not bool(torch.isfinite(logits).all()):
        raise RequestError(f"{name}: must be finite (NaN or inf found)")
    return logits
