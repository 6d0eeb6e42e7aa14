"""Perplexity of fixed windows of real text through three paths on the same weights: our runtime
(ModelRunner: several windows packed into one forward over the paged KV cache, context logits),
GptSession (static batch, gathered context logits) and transformers. Each window's perplexity is
exp(mean negative log likelihood of its tokens 2..n)."""
from __future__ import annotations

import math

import torch

from runtime import Engine, GenerationInput, GenerationOutput, GptSession, SamplingConfig, WorldConfig
from runtime.model_runner import ModelRunner
from runtime.step_inputs import SequenceStep, pack_step


def window_nll(logits: torch.Tensor, window: list[int]) -> float:
    """Mean negative log likelihood of window[1:] given logits [len(window), V] of every position."""
    targets = torch.tensor(window[1:], dtype=torch.int64)
    log_probs = torch.log_softmax(logits[:-1].double(), dim=-1)
    return -log_probs.gather(1, targets[:, None]).mean().item()


def runtime_nll(model_dir: str, windows: list[list[int]], windows_per_step: int = 4) -> list[float]:
    """Windows packed `windows_per_step` to a forward, each in its own blocks, context logits gathered."""
    engine = Engine.from_dir(model_dir)
    block = engine.build_config.tokens_per_block
    blocks_per_window = math.ceil(max(map(len, windows)) / block)
    runner = ModelRunner(engine, num_blocks=windows_per_step * blocks_per_window)
    nll = []
    for first in range(0, len(windows), windows_per_step):
        group = windows[first:first + windows_per_step]
        steps = [SequenceStep(w, 0, list(range(i * blocks_per_window, (i + 1) * blocks_per_window)), True)
                 for i, w in enumerate(group)]
        logits = runner.forward(pack_step(steps))["context_logits"]   # [sum of lengths, V]
        offset = 0
        for w in group:
            nll.append(window_nll(logits[offset:offset + len(w)], w))
            offset += len(w)
    return nll


def session_nll(model_dir: str, windows: list[list[int]], batch_size: int = 4) -> list[float]:
    """GptSession with gather_context_logits, one new token per window (its logits are not used)."""
    engine = Engine.from_dir(model_dir, gather_context_logits=True)
    window_len = max(map(len, windows))
    session = GptSession(GptSession.Config(max_batch_size=batch_size, max_beam_width=1,
                                           max_sequence_length=window_len + 1),
                         engine.model_config, WorldConfig(), engine)
    nll = []
    for first in range(0, len(windows), batch_size):
        group = windows[first:first + batch_size]
        ids = torch.zeros(len(group), window_len, dtype=torch.int32)
        for i, w in enumerate(group):
            ids[i, :len(w)] = torch.tensor(w, dtype=torch.int32)
        inp = GenerationInput(0, 0, ids, torch.tensor([len(w) for w in group], dtype=torch.int32), packed=False)
        inp.max_new_tokens = 1
        out = GenerationOutput(ids=torch.empty(0, dtype=torch.int32), lengths=torch.empty(0, dtype=torch.int32))
        session.generate(out, inp, SamplingConfig(beam_width=1))
        nll += [window_nll(out.context_logits[i, :len(w)], w) for i, w in enumerate(group)]
    return nll


@torch.inference_mode()
def reference_nll(model, windows: list[list[int]], batch_size: int = 4) -> list[float]:
    nll = []
    for first in range(0, len(windows), batch_size):
        group = windows[first:first + batch_size]
        assert len(set(map(len, group))) == 1, "the reference batches equal-length windows"
        logits = model(torch.tensor(group, dtype=torch.int64)).logits.float()
        nll += [window_nll(logits[i], w) for i, w in enumerate(group)]
    return nll


def report(paths: dict[str, list[float]], reference: str) -> dict:
    """Perplexity of each path over all windows, and each path's largest per-window relative
    difference of perplexity from the reference's."""
    ref = paths[reference]
    out = {}
    for name, nll in paths.items():
        ppl = [math.exp(x) for x in nll]
        rel = [abs(math.exp(a) - math.exp(b)) / math.exp(b) for a, b in zip(nll, ref)]
        out[name] = {"perplexity": math.exp(sum(nll) / len(nll)), "max_window_rel_diff": max(rel),
                     "windows_within_1e-4": sum(r <= 1e-4 for r in rel), "num_windows": len(ppl)}
    return out
