"""Dynamo's prefill / decode roles over the Executor's context-only / generation-only requests.
A prefill worker runs the prompt as REQUEST_TYPE_CONTEXT_ONLY; its terminal chunk carries the
first token and `disaggregated_params` {"context_phase_params": base64 of ContextPhaseParams'
msgpack bytes}, which Dynamo's PrefillRouter forwards to a decode worker as
`request["prefill_result"]`. The decode worker runs REQUEST_TYPE_GENERATION_ONLY with those params:
it fetches the blocks from the prefill worker over the engine's own KV transfer (TCP), emits the
first token, then what it generates. Pure mapping: no Dynamo import."""
from __future__ import annotations

import base64
import binascii

from batch_manager.executor import ContextPhaseParams, Request, RequestType, Result

PARAMS_KEY = "context_phase_params"
ROLES = ("agg", "prefill", "decode")


def as_context_only(request: Request) -> Request:
    request.request_type = RequestType.REQUEST_TYPE_CONTEXT_ONLY
    return request


def handoff(result: Result) -> dict | None:
    """A context-only final result -> the terminal chunk's disaggregated_params (None when its
    first token already ended it: nothing for a decode worker to continue)."""
    if result.context_phase_params is None:
        return None
    return {PARAMS_KEY: base64.b64encode(result.context_phase_params.to_bytes()).decode("ascii")}


def as_generation_only(request: Request, dynamo_request: dict) -> list[int]:
    """Make `request` resume from the prefill worker's params in `prefill_result`; -> the first
    token(s) the prefill produced, which the decode stream emits first. ValueError naming the
    field for a missing or malformed hand-off."""
    prefill = dynamo_request.get("prefill_result")
    params = prefill.get("disaggregated_params") if isinstance(prefill, dict) else None
    encoded = params.get(PARAMS_KEY) if isinstance(params, dict) else None
    if not isinstance(encoded, str):
        raise ValueError(f"prefill_result.disaggregated_params.{PARAMS_KEY}: missing (a decode worker serves "
                         "requests routed through a prefill worker of this engine)")
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"prefill_result.disaggregated_params.{PARAMS_KEY}: not base64") from None
    context_phase_params = ContextPhaseParams.from_bytes(raw)
    request.request_type = RequestType.REQUEST_TYPE_GENERATION_ONLY
    request.context_phase_params = context_phase_params
    return list(context_phase_params.first_gen_tokens)
