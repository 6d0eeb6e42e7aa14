"""An Executor `Result` -> the chunk Dynamo's `generate` yields: `{"token_ids": [new ids], "index":
sequence}`, with `log_probs` / `top_logprobs` aligned to the ids when asked, and on a sequence's
last chunk its `finish_reason`; the request's last chunk also carries `completion_usage`. Pure."""
from __future__ import annotations

from typing import Callable

from batch_manager.executor import FinishReason, Result
from samples.dynamo.request_map import finish_reason_name


def _top_logprobs(result: Result, num_tokens: int, token_text: Callable[[int], str]) -> list[list[dict]]:
    values, ids = result.top_log_probs[0].tolist(), result.top_log_prob_ids[0].tolist()
    return [[{"rank": rank + 1, "token_id": token_id, "token": token_text(token_id), "logprob": value}
             for rank, (value, token_id) in enumerate(zip(values[i], ids[i]))] for i in range(num_tokens)]


def result_chunk(result: Result, num_top_log_probs: int | None, token_text: Callable[[int], str]) -> dict:
    """The chunk of one streamed result (new tokens only); finish_reason when its sequence ended."""
    token_ids = list(result.output_token_ids[0])
    chunk = {"token_ids": token_ids, "index": result.sequence_index}
    if num_top_log_probs is not None and token_ids and result.log_probs is not None:
        chunk["log_probs"] = [float(v) for v in result.log_probs[0].tolist()[:len(token_ids)]]
        if num_top_log_probs > 0 and result.top_log_probs is not None:
            chunk["top_logprobs"] = _top_logprobs(result, len(token_ids), token_text)
    is_sequence_final = result.is_final or result.is_sequence_final
    if is_sequence_final:
        reason = result.finish_reasons[0]
        chunk["finish_reason"] = finish_reason_name(reason) or finish_reason_name(FinishReason.LENGTH)
    return chunk


def truncate(chunk: dict, num_tokens: int) -> None:
    """Keep the chunk's first `num_tokens` tokens (and their log probs)."""
    for key in ("token_ids", "log_probs", "top_logprobs"):
        if key in chunk:
            chunk[key] = chunk[key][:max(num_tokens, 0)]


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}
