"""The decoding kernels on a GPU (skipped without a CUDA device and CuPy): every op on the device
equals the torch reference (run on the CPU, the oracle) under the emu tests' checks, and a GptSession
run on the cuda backend yields the torch backend's tokens. The sampling time at batch 256 with a
128k vocabulary: `python -m samples.microbench.kernels`."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime import rng
from runtime.kernels.cuda.cuda_backend import CudaKernels, cuda_available
from tests.runtime.kernels import test_emu_decoder_kernels as emu_tests

DEVICE = "cuda"
pytestmark = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device and CuPy")


class OnDevice:
    """A backend's decoding ops called with the arguments moved to DEVICE and the results moved back
    (in-place ops write back into the caller's CPU tensors)."""

    def __init__(self, kernels):
        self.kernels = kernels

    @staticmethod
    def _to(args):
        return [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args]

    def _call(self, name, *args):
        out = getattr(self.kernels, name)(*self._to(args))
        return out.cpu() if isinstance(out, torch.Tensor) else tuple(t.cpu() for t in out)

    def uniforms(self, *args):
        return self._call("uniforms", *args)

    def greedy(self, *args):
        return self._call("greedy", *args)

    def log_softmax(self, *args):
        return self._call("log_softmax", *args)

    def sample(self, *args):
        return self._call("sample", *args)

    def beam_candidates(self, *args):
        return self._call("beam_candidates", *args)

    def apply_penalties(self, logits, **kwargs):
        on_device = logits.to(DEVICE)
        self.kernels.apply_penalties(on_device, **{k: None if v is None else v.to(DEVICE) for k, v in kwargs.items()})
        logits.copy_(on_device.cpu())

    def ban_tokens(self, logits, row_ids, token_ids):
        on_device = logits.to(DEVICE)
        self.kernels.ban_tokens(on_device, row_ids.to(DEVICE), token_ids.to(DEVICE))
        logits.copy_(on_device.cpu())


@pytest.fixture(scope="module")
def device_kernels():
    return OnDevice(CudaKernels())


def test_uniforms_are_bit_identical_on_the_device(device_kernels):
    seeds = [0, 2 ** 64 - 1, 12345, 2 ** 63 + 7]
    steps, beams = [0, 9, 2 ** 32 + 1, 4], [0, 3, 1, 0]
    got = device_kernels.uniforms(torch.tensor(np.array(seeds, dtype=np.uint64).view(np.int64)), torch.tensor(steps),
                                  torch.tensor(beams))
    assert np.array_equal(got.numpy().view(np.uint32), rng.uniforms(seeds, steps, beams).view(np.uint32))


@pytest.mark.parametrize("vocab, picked", [(33, [2, 0]), (32000, [1, 4, 3])])
def test_penalties_and_bans_equal_torch_on_the_device(device_kernels, reference, vocab, picked):
    logits, args = emu_tests.penalty_case(6, vocab, picked, 40, seed=vocab, bias=True)
    expected = logits.clone()
    reference.apply_penalties(expected, **args)
    device_kernels.apply_penalties(logits, **args)
    assert torch.equal(logits, expected)
    rows, tokens = torch.tensor([0, 5, 5]), torch.tensor([vocab - 1, 0, 7])
    reference.ban_tokens(expected, rows, tokens)
    device_kernels.ban_tokens(logits, rows, tokens)
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("case", list(emu_tests.logits_cases()))
def test_greedy_and_log_softmax_equal_torch_on_the_device(device_kernels, reference, case):
    emu_tests.test_greedy_equals_the_reference(device_kernels, reference, case)
    emu_tests.test_log_softmax_equals_the_reference(device_kernels, reference, case)


@pytest.mark.parametrize("vocab, top_k, top_p", [(300, 0, 0.0), (32000, 50, 0.0), (32000, 0, 0.9), (128256, 40, 0.8),
                                                 (77, 1, 0.0), (515, 0, 1e-6), (1000, 1000, 0.5)])
def test_sampling_equals_torch_on_the_device(device_kernels, reference, vocab, top_k, top_p):
    row = emu_tests.random_logits(1, vocab, seed=vocab + top_k, scale=2.0)[0]
    emu_tests.check_sample(device_kernels, reference,
                           *emu_tests.draws_of_one_row(row, top_k, top_p, 500, seed=top_k, normalize=top_k % 2 == 0))


@pytest.mark.parametrize("seed", range(3))
def test_mixed_rows_and_ties_equal_torch_on_the_device(device_kernels, reference, seed):
    emu_tests.test_mixed_rows_equal_the_reference(device_kernels, reference, seed)
    emu_tests.test_ties_at_the_kth_place_keep_the_lowest_ids(device_kernels, reference)
    emu_tests.test_ties_at_the_top_p_cut_keep_the_lowest_ids(device_kernels, reference)
    emu_tests.test_top_k_beyond_the_finite_tokens_never_draws_a_banned_one(device_kernels, reference)


@pytest.mark.parametrize("num_beams, vocab, num_candidates", [(1, 50, 2), (4, 32000, 8), (4, 3, 8)])
@pytest.mark.parametrize("diversity_rate", [0.0, 0.7])
def test_beam_candidates_equal_torch_on_the_device(device_kernels, reference, num_beams, vocab, num_candidates,
                                                   diversity_rate):
    emu_tests.test_beam_candidates_equal_the_reference_exactly(device_kernels, reference, num_beams, vocab,
                                                               num_candidates, diversity_rate)


def test_gpt_session_on_the_device_yields_the_torch_tokens(tmp_path):
    from runtime import Engine, GenerationInput, GenerationOutput, GptSession, SamplingConfig, WorldConfig
    from tests.factories import make_checkpoint
    make_checkpoint(tmp_path, "llama", seed=3)
    engine = Engine.from_dir(tmp_path, tokens_per_block=4)
    config = GptSession.Config(max_batch_size=4, max_beam_width=3, max_sequence_length=32)
    sessions = {name: GptSession(config, engine.model_config, WorldConfig(), engine, kernels=kernels, device=DEVICE)
                for name, kernels in (("torch", "torch"), ("cuda", CudaKernels()))}
    prompts = emu_tests.PROMPTS
    mixed = SamplingConfig(top_k=[5, 0, 1000, 20], top_p=[0.0, 0.8, 0.0, 0.7], temperature=[0.8, 1.0, 1.3, 1.0],
                           repetition_penalty=[1.0, 1.3, 1.0, 1.1], random_seed=[1, 2, 3, 4])
    runs = [(prompts, mixed), (prompts[:2], SamplingConfig(top_k=1)),
            (prompts[1:3], SamplingConfig(beam_width=3, beam_search_diversity_rate=[0.0, 0.6]))]
    for batch, sampling in runs:
        ids = {}
        for name, session in sessions.items():
            inp = GenerationInput(end_id=2, pad_id=0, ids=torch.tensor([t for p in batch for t in p]),
                                  lengths=torch.tensor([len(p) for p in batch]), packed=True, max_new_tokens=10)
            out = GenerationOutput()
            session.generate(out, inp, sampling)
            ids[name] = out.ids
        assert torch.equal(ids["cuda"], ids["torch"]), sampling
