"""Our serving path (the Executor) against transformers on chat prompts: greedy tokens (the first
position where they differ, if any) and, for sampled requests, the log prob of each drawn token
against transformers' logits processed the same way (temperature, then top-k, renormalised)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from batch_manager.executor import Executor, ExecutorConfig, KvCacheConfig, ModelType, OutputConfig, Request, SamplingConfig


@dataclass(frozen=True)
class SampledCheck:
    temperature: float = 0.8
    top_k: int = 40
    seed: int = 1


def serve(model_dir: str, prompts: list[list[int]], max_tokens: int, end_id: int,
          sampling: SampledCheck | None = None) -> list[tuple[list[int], list[float]]]:
    """(generated tokens, their log probs) per prompt, all in flight together through one Executor."""
    config = ExecutorConfig(kv_cache_config=KvCacheConfig(max_tokens=sum(len(p) + max_tokens + 64 for p in prompts)))
    outputs: dict[int, tuple[list[int], list[float]]] = {}
    with Executor(model_dir, ModelType.DECODER_ONLY, config) as executor:
        ids = []
        for i, prompt in enumerate(prompts):
            sampling_config = (SamplingConfig(temperature=sampling.temperature, top_k=sampling.top_k,
                                              seed=sampling.seed + i) if sampling else SamplingConfig())
            ids.append(executor.enqueue_request(Request(
                prompt, max_tokens, end_id=end_id, sampling_config=sampling_config,
                output_config=OutputConfig(return_log_probs=True, exclude_input_from_output=True))))
        for request_id in ids:
            while request_id not in outputs:
                for response in executor.await_responses(request_id, timeout=600.0):
                    if response.has_error():
                        raise RuntimeError(f"request {request_id}: {response.error_msg}")
                    if response.result.is_final:
                        outputs[request_id] = (response.result.output_token_ids[0], response.result.log_probs[0])
    return [outputs[i] for i in ids]


@torch.inference_mode()
def reference_greedy(model, prompts: list[list[int]], max_tokens: int, end_id: int) -> list[list[int]]:
    out = []
    for prompt in prompts:
        # NOTE: an explicit mask: without one transformers masks every prompt token equal to the
        # pad id, and SmolLM2's pad id is its end of turn, which chat prompts contain.
        ids = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                             max_new_tokens=max_tokens, do_sample=False, eos_token_id=end_id,
                             pad_token_id=end_id)[0, len(prompt):].tolist()
        out.append(ids[:ids.index(end_id)] if end_id in ids else ids)   # as ours: the end id is not output
    return out


def first_difference(ours: list[int], theirs: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return i
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


@torch.inference_mode()
def reference_log_probs(model, prompt: list[int], tokens: list[int], sampling: SampledCheck) -> list[float]:
    """log p(token) under transformers' logits / temperature, restricted to the top-k and renormalised."""
    if not tokens:
        return []
    logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:].double() / sampling.temperature
    kth = logits.topk(sampling.top_k, dim=-1).values[:, -1:]
    log_probs = torch.log_softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)
    return log_probs.gather(1, torch.tensor(tokens)[:, None]).squeeze(1).tolist()


def greedy_report(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    differences = [first_difference(a, b) for a, b in zip(ours, theirs)]
    return {"num_prompts": len(ours), "num_equal": sum(d is None for d in differences),
            "first_differences": {i: d for i, d in enumerate(differences) if d is not None},
            "num_tokens": sum(map(len, ours))}


def sampled_report(model, prompts: list[list[int]], served, sampling: SampledCheck) -> dict:
    max_diff, count = 0.0, 0
    for prompt, (tokens, log_probs) in zip(prompts, served):
        expected = reference_log_probs(model, prompt, tokens, sampling)
        for a, b in zip(log_probs, expected):
            max_diff, count = max(max_diff, abs(a - b)), count + 1
    return {"num_tokens": count, "max_abs_log_prob_diff": float(max_diff), "within_1e-4": bool(max_diff <= 1e-4)}
