"""Dynamo's prefill / decode roles over the Executor's context-only / generation-only requests.
A prefill worker runs the prompt as REQUEST_TYPE_CONTEXT_ONLY; its terminal chunk carries the
first token and `disaggregated_params` {"context_phase_params": base64 of ContextPhaseParams'
msgpack bytes}, which Dynamo's PrefillRouter forwards to a decode worker as
`request["prefill_result"]`. The decode worker runs REQUEST_TYPE_GENERATION_ONLY with those params:
it fetches the blocks from the prefill worker over the engine's own KV transfer (TCP), emits the
first token, then what it generates. Pure mapping: no Dynamo import.

NOTE: the PrefillRouter sends the prefill worker max_tokens 1, the decode worker the user's; the
two requests must agree on max_tokens (the Executor checks it), so both ask for all the room
max_seq_len leaves and the decode worker ends the stream at the user's max_tokens itself."""
from __future__ import annotations

import base64
import binascii

from batch_manager.executor import ContextPhaseParams, Request, RequestType, Result

PARAMS_KEY = "context_phase_params"
FINISHED_KEY = "finish_reason"     # the hand-off of a request the prefill's first token ended


def widen_to_room(request: Request, max_seq_len: int) -> int:
    """Ask for every token max_seq_len leaves (what both roles agree on); -> what the user asked."""
    asked, request.max_tokens = request.max_tokens, max_seq_len - len(request.input_token_ids)
    return asked


def as_context_only(request: Request, max_seq_len: int) -> None:
    widen_to_room(request, max_seq_len)
    request.request_type = RequestType.REQUEST_TYPE_CONTEXT_ONLY


def handoff(result: Result, finish_reason: str | None) -> dict:
    """A context-only final result -> the terminal chunk's disaggregated_params: the params, or,
    when its first token already ended it, that token and the reason (the decode worker repeats
    them: Dynamo's PrefillRouter fails a prefill response without disaggregated_params)."""
    if result.context_phase_params is None:
        return {FINISHED_KEY: finish_reason or "stop", "first_gen_tokens": list(result.output_token_ids[0])}
    return {PARAMS_KEY: base64.b64encode(result.context_phase_params.to_bytes()).decode("ascii")}


def as_generation_only(request: Request, dynamo_request: dict, max_seq_len: int) -> tuple[list[int], int, str | None]:
    """Make `request` resume from the prefill worker's params in `prefill_result`; -> (the first
    token(s) the prefill produced, which the decode stream emits first; the user's max_tokens;
    the finish reason when the prefill already ended the request, else None). ValueError naming
    the field for a missing or malformed hand-off."""
    prefill = dynamo_request.get("prefill_result")
    params = prefill.get("disaggregated_params") if isinstance(prefill, dict) else None
    if isinstance(params, dict) and isinstance(params.get(FINISHED_KEY), str):
        first = params.get("first_gen_tokens")
        if not isinstance(first, list) or not all(type(t) is int for t in first):
            raise ValueError("prefill_result.disaggregated_params.first_gen_tokens: expected token ids")
        return first, request.max_tokens, params[FINISHED_KEY]
    encoded = params.get(PARAMS_KEY) if isinstance(params, dict) else None
    if not isinstance(encoded, str):
        raise ValueError(f"prefill_result.disaggregated_params.{PARAMS_KEY}: missing (a decode worker serves "
                         "requests routed through a prefill worker of this engine)")
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"prefill_result.disaggregated_params.{PARAMS_KEY}: not base64") from None
    context_phase_params = ContextPhaseParams.from_bytes(raw)
    asked = widen_to_room(request, max_seq_len)
    request.request_type = RequestType.REQUEST_TYPE_GENERATION_ONLY
    request.context_phase_params = context_phase_params
    return list(context_phase_params.first_gen_tokens), asked, None
