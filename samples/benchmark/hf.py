"""The Hugging Face baseline of samples.benchmark: the same dataset through transformers' static
`generate` (batched, left-padded, greedy), offline.

Token accounting: a padded static batch runs until its longest request is done; each request is
credited with the tokens it asked for (its output_len), the same count as for our backend, so
the throughputs compare the same useful work. The tokens generated past a request's output_len
(wasted on padding) are reported separately as `padded_token_throughput(token/sec)`.
"""
from __future__ import annotations

import os
import time

import torch

from samples.benchmark.dataset import Sample
from samples.benchmark.report import RequestTiming, RunResult, progress_bar


def load_hf_model(model_dir: str):
    """transformers' model for an HF checkpoint directory, a GGUF file or an engine directory built
    from one (other engine directories have no HF form)."""
    from samples.quality.reference import gguf_source, load_reference_model
    if gguf_source(model_dir) is None and not os.path.exists(os.path.join(model_dir, "config.json")):
        raise ValueError(f"--engine-dir: {model_dir!r} is not a Hugging Face checkpoint directory "
                         "(no config.json) nor built from a GGUF file; the hf backend needs one")
    return load_reference_model(model_dir, attn_implementation=None)


def run_hf(model_dir: str, samples: list[Sample], batch_size: int, pad_id: int = 0,
           show_progress: bool = True) -> RunResult:
    """Generate every sample in dataset order, `batch_size` at a time; arrival delays are ignored."""
    if batch_size <= 0:
        raise ValueError(f"--hf-batch-size: must be positive, got {batch_size}")
    model = load_hf_model(model_dir)
    with torch.inference_mode():  # warm-up: one tiny batch, untimed
        model.generate(torch.tensor([samples[0].input_ids[:8]]), max_new_tokens=2, min_new_tokens=2,
                       do_sample=False, eos_token_id=None, pad_token_id=pad_id)
    timings = [RequestTiming(enqueue_s=0.0) for _ in samples]
    token_events: list[tuple[float, int]] = []
    num_padded_tokens = 0
    progress = progress_bar(len(samples), "hf", show_progress)
    start_s = time.perf_counter()
    for first in range(0, len(samples), batch_size):
        batch = samples[first:first + batch_size]
        ids, mask = left_padded(batch, pad_id)
        max_new_tokens = max(s.output_len for s in batch)
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                           do_sample=False, eos_token_id=None, pad_token_id=pad_id)
        end_s = time.perf_counter() - start_s
        for i, s in enumerate(batch):
            t = timings[first + i]
            t.num_output_tokens, t.first_token_s, t.end_s = s.output_len, end_s, end_s
        token_events.append((end_s, sum(s.output_len for s in batch)))
        num_padded_tokens += max_new_tokens * len(batch)
        progress.update(len(batch))
    total_s = time.perf_counter() - start_s
    progress.close()
    return RunResult("hf", timings, total_s, token_events, extra={
        "hf_batch_size": batch_size,
        "padded_token_throughput(token/sec)": num_padded_tokens / total_s})


def left_padded(batch: list[Sample], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids int64 [batch, max_len], attention_mask int64 [batch, max_len]), padded on the left."""
    width = max(len(s.input_ids) for s in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(batch), width), dtype=torch.int64)
    for row, s in enumerate(batch):
        ids[row, width - len(s.input_ids):] = torch.tensor(s.input_ids)
        mask[row, width - len(s.input_ids):] = 1
    return ids, mask
