"""sampling.cu's greedy and sampler on emu never choose a token whose logit is -inf: a row with
no allowed token (a guide's mask and the bans leaving nothing) yields NO_TOKEN with log prob -inf,
as the torch reference does, and the other rows of the batch draw as they would alone."""
from __future__ import annotations

import torch

from runtime.kernels.interface import NO_TOKEN
from tests.runtime.test_decoder_kernels import rows_with_no_allowed_token


def test_a_row_with_no_allowed_token_yields_no_token_as_the_reference(emu, reference):
    logits, top_k, top_p, u, normalize = rows_with_no_allowed_token(40, seed=3)
    empty = [1, 3, 4]
    for got, expected in ((emu.greedy(logits), reference.greedy(logits)),
                          (emu.sample(logits, top_k, top_p, u, normalize),
                           reference.sample(logits, top_k, top_p, u, normalize))):
        assert got[0].tolist() == expected[0].tolist()
        assert got[0][empty].tolist() == [NO_TOKEN] * 3 and got[1][empty].tolist() == [float("-inf")] * 3
        torch.testing.assert_close(got[1], expected[1], atol=1e-5, rtol=0)
