"""Run under ThreadSanitizer in a child process (libtsan preloaded): `python -m
tests.runtime.kernels.tsan_decoding_probe`. Exit status 66 when TSan reports a race in the
decoding kernels (penalties, greedy, log-softmax, sampling with tie cuts, beam candidates)."""
from __future__ import annotations

import torch

from runtime.kernels.cuda import emu_backend
from tests.runtime.kernels import test_emu_decoder_kernels as cases


def decoding_kernels() -> None:
    kernels = emu_backend.EmuKernels(dtypes=(torch.float32,), cxx_flags=emu_backend.TSAN_CXX_FLAGS)
    logits, args = cases.penalty_case(3, 70, [0, 2], 9, seed=1, bias=True)
    kernels.apply_penalties(logits, **args)
    kernels.ban_tokens(logits, torch.tensor([1]), torch.tensor([5]))
    kernels.greedy(logits)
    kernels.log_softmax(logits)
    row = torch.full((40,), -3.0)
    row[[2, 5, 6, 9, 11, 15, 17, 19]] = 1.0
    rows = row[None].expand(4, -1)
    kernels.sample(rows, torch.tensor([0, 5, 3, 0]), torch.tensor([0.3, 0.5, 0.0, 0.0]), torch.rand(4),
                   torch.tensor([True, False, True, False]))
    kernels.beam_candidates(torch.log_softmax(logits, -1), torch.tensor([-1.0, -2.0, -0.5]), 6, 0.5)


if __name__ == "__main__":
    decoding_kernels()
