"""Typed launchers of the decoding kernels (cuda_src/philox.cu, logits_processing.cu, sampling.cu,
beam_search.cu, token_filters.cu), shared by the cuda and emu backends; the conventions (exact C
argument types, empty-work guards, the backend's stream per launch) are those of launchers.py.
"""
from __future__ import annotations

from typing import Callable

import torch

from .launchers import KvLaunchers, LaunchConfig, c_float, c_int, c_long_long, c_ptr

MIN_COLUMNS_PER_THREAD = 16


def decoding_block(vocab: int, config: LaunchConfig) -> int:
    """Threads of a per-row decoding CTA: a multiple of 32 giving each thread at least
    MIN_COLUMNS_PER_THREAD columns, at most config.decoding_threads.

    NOTE: a small vocabulary gets a small block (a 128-column row needs one warp): more rows fit
    an SM at once, and the emu backend's barriers stay cheap.
    """
    wanted = 32 * -(-vocab // (32 * MIN_COLUMNS_PER_THREAD))
    return max(32, min(config.decoding_threads, wanted))


class DecodingLaunchers:
    """The launchers of the decoding kernels. Logits are float32 whatever the storage dtype; these
    modules do not depend on it, so the backend hands any compiled dtype's module (`dtype`)."""

    _check = KvLaunchers._check

    def __init__(self, function: Callable, device_type: str, stream: Callable, config: LaunchConfig,
                 dtype: torch.dtype):
        self._kernel = lambda name: function(dtype, name)   # kernel name -> launchable kernel
        self._device_type = device_type
        self._stream = stream
        self.config = config

    def _vectors(self, n: int, dtype: torch.dtype, **tensors: torch.Tensor) -> None:
        for name, t in tensors.items():
            self._check(name, t, dtype, 1)
            assert t.shape == (n,) and t.is_contiguous(), f"{name}: shape {list(t.shape)}, expected [{n}] contiguous"

    def _logits(self, name: str, logits: torch.Tensor) -> None:
        self._check(name, logits, torch.float32, 2)
        assert logits.stride(1) == 1 or logits.shape[1] <= 1, f"{name}: columns must be contiguous"

    def _rows(self, name: str, num_rows: int, vocab: int, args: tuple, device: torch.device) -> None:
        """One CTA per row, decoding_block(vocab) threads (nothing for empty work)."""
        if num_rows and vocab:
            self._kernel(name)((num_rows,), (decoding_block(vocab, self.config),), args, shared_mem=0,
                               stream=self._stream(device))

    def _elementwise(self, name: str, n: int, args: tuple, device: torch.device) -> None:
        threads = self.config.copy_threads
        self._kernel(name)((-(-n // threads),), (threads,), args, shared_mem=0, stream=self._stream(device))

    def uniforms(self, out: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, beams: torch.Tensor,
                 lane: int = 0) -> None:
        """out float32 [n] <- Philox(seed, step, beam, lane); seeds (uint64 bit patterns), steps, beams int64 [n]."""
        n = out.shape[0]
        self._vectors(n, torch.float32, out=out)
        self._vectors(n, torch.int64, seeds=seeds, steps=steps, beams=beams)
        if n:
            self._elementwise("philox_uniforms", n, (c_ptr(out), c_ptr(seeds), c_ptr(steps), c_ptr(beams), c_int(n),
                                                     c_int(lane)), out.device)

    def philox_raw(self, out: torch.Tensor, counters: torch.Tensor, keys: torch.Tensor) -> None:
        """The raw block function: counters int32 [n, 4], keys int32 [n, 2] (uint32 bit patterns) -> out [n, 4]."""
        for name, t, width in (("out", out, 4), ("counters", counters, 4), ("keys", keys, 2)):
            self._check(name, t, torch.int32, 2)
            assert t.shape == (out.shape[0], width) and t.is_contiguous(), f"{name}: shape {list(t.shape)}"
        if out.shape[0]:
            self._elementwise("philox4x32_raw", out.shape[0], (c_ptr(out), c_ptr(counters), c_ptr(keys),
                                                               c_int(out.shape[0])), out.device)

    def apply_penalties(self, logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor,
                        token_lengths: torch.Tensor, embedding_bias: torch.Tensor | None, temperature: torch.Tensor,
                        repetition: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor,
                        min_lengths: torch.Tensor, num_generated: torch.Tensor, end_ids: torch.Tensor) -> None:
        """In place on logits float32 [R, V] rows `rows` int64 [n] (distinct); token_ids int64 [n, L];
        embedding_bias float32 [n, V] or None; per-row float32 / int64 [n] settings. All contiguous."""
        self._logits("logits", logits)
        n, vocab = rows.shape[0], logits.shape[1]
        self._vectors(n, torch.int64, rows=rows, token_lengths=token_lengths, min_lengths=min_lengths,
                      num_generated=num_generated, end_ids=end_ids)
        self._vectors(n, torch.float32, temperature=temperature, repetition=repetition, presence=presence,
                      frequency=frequency)
        self._check("token_ids", token_ids, torch.int64, 2)
        assert token_ids.shape[0] == n and token_ids.is_contiguous(), f"token_ids: shape {list(token_ids.shape)}"
        if embedding_bias is not None:
            self._check("embedding_bias", embedding_bias, torch.float32, 2)
            assert embedding_bias.shape == (n, vocab) and embedding_bias.is_contiguous()
        # NOTE: n x vocab int32 of histogram workspace, freed on return (torch's allocator is stream-ordered)
        counts = torch.empty(n, vocab, dtype=torch.int32, device=logits.device)
        self._rows("apply_penalties", n, vocab,
                   (c_ptr(logits), c_ptr(counts), c_ptr(rows), c_ptr(token_ids), c_ptr(token_lengths),
                    c_ptr(embedding_bias), c_ptr(temperature), c_ptr(repetition), c_ptr(presence), c_ptr(frequency),
                    c_ptr(min_lengths), c_ptr(num_generated), c_ptr(end_ids), c_int(vocab),
                    c_long_long(logits.stride(0)), c_int(token_ids.shape[1])), logits.device)

    def ban_tokens(self, logits: torch.Tensor, row_ids: torch.Tensor, token_ids: torch.Tensor) -> None:
        """logits float32 [R, V][row_ids[i], token_ids[i]] = -inf; int64 [m] each (out-of-range pairs skipped)."""
        self._logits("logits", logits)
        m = row_ids.shape[0]
        self._vectors(m, torch.int64, row_ids=row_ids, token_ids=token_ids)
        if m == 0 or logits.numel() == 0:
            return
        self._elementwise("ban_tokens", m, (c_ptr(logits), c_ptr(row_ids), c_ptr(token_ids), c_int(m),
                                            c_long_long(logits.shape[0]), c_int(logits.shape[1]),
                                            c_long_long(logits.stride(0))), logits.device)

    def _per_row(self, name: str, logits: torch.Tensor, outputs: tuple, inputs: tuple = ()) -> None:
        num_rows, vocab = logits.shape
        assert vocab > 0 or num_rows == 0, "an empty vocabulary has no token to pick"
        self._rows(name, num_rows, vocab, (*(c_ptr(t) for t in outputs), c_ptr(logits), *(c_ptr(t) for t in inputs),
                                           c_int(vocab), c_long_long(logits.stride(0))), logits.device)

    def greedy(self, logits: torch.Tensor, tokens: torch.Tensor, log_probs: torch.Tensor) -> None:
        """logits float32 [R, V] -> tokens int64 [R] (first maximum; NO_TOKEN for a row with no
        allowed token), log_probs float32 [R]."""
        self._logits("logits", logits)
        self._vectors(logits.shape[0], torch.int64, tokens=tokens)
        self._vectors(logits.shape[0], torch.float32, log_probs=log_probs)
        self._per_row("greedy_tokens", logits, (tokens, log_probs))

    def log_softmax(self, logits: torch.Tensor, out: torch.Tensor) -> None:
        """logits float32 [R, V] -> out float32 [R, V] (contiguous)."""
        self._logits("logits", logits)
        self._check("out", out, torch.float32, 2)
        assert out.shape == logits.shape and out.is_contiguous()
        self._per_row("log_softmax_rows", logits, (out,))

    def sample(self, logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor,
               normalize: torch.Tensor, tokens: torch.Tensor, log_probs: torch.Tensor) -> None:
        """logits float32 [R, V]; top_k int64, top_p float32, uniforms float32, normalize bool [R] ->
        tokens int64 [R] (NO_TOKEN for a row with no allowed token), log_probs float32 [R]."""
        num_rows = logits.shape[0]
        self._logits("logits", logits)
        self._vectors(num_rows, torch.int64, top_k=top_k, tokens=tokens)
        self._vectors(num_rows, torch.float32, top_p=top_p, uniforms=uniforms, log_probs=log_probs)
        self._vectors(num_rows, torch.bool, normalize=normalize)
        self._per_row("sample_tokens", logits, (tokens, log_probs), (top_k, top_p, uniforms, normalize))

    def apply_token_bitmask(self, logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
        """logits float32 [R, V] in place: rows int64 [n], bitmask int32 [n, words >= ceil(V / 32)] (contiguous)."""
        self._logits("logits", logits)
        n, vocab = rows.shape[0], logits.shape[1]
        self._vectors(n, torch.int64, rows=rows)
        self._check("bitmask", bitmask, torch.int32, 2)
        assert bitmask.shape[0] == n and bitmask.shape[1] * 32 >= vocab and bitmask.is_contiguous(), \
            f"bitmask: shape {list(bitmask.shape)} for {n} rows of {vocab} tokens"
        self._rows("apply_token_bitmask", n, vocab, (c_ptr(logits), c_ptr(rows), c_ptr(bitmask),
                                                     c_int(bitmask.shape[1]), c_int(vocab),
                                                     c_long_long(logits.stride(0))), logits.device)

    def apply_min_p(self, logits: torch.Tensor, rows: torch.Tensor, min_p: torch.Tensor) -> None:
        """logits float32 [R, V] in place: rows int64 [n], min_p float32 [n]."""
        self._logits("logits", logits)
        n, vocab = rows.shape[0], logits.shape[1]
        self._vectors(n, torch.int64, rows=rows)
        self._vectors(n, torch.float32, min_p=min_p)
        self._rows("apply_min_p", n, vocab, (c_ptr(logits), c_ptr(rows), c_ptr(min_p), c_int(vocab),
                                             c_long_long(logits.stride(0))), logits.device)

    def top_log_probs(self, logits: torch.Tensor, k: int, values: torch.Tensor, ids: torch.Tensor) -> None:
        """logits float32 [R, V] -> values float32 [R, k], ids int64 [R, k] (contiguous), 1 <= k <= V."""
        self._logits("logits", logits)
        num_rows, vocab = logits.shape
        assert 1 <= k <= vocab, f"k: {k} outside [1, {vocab}]"
        self._check("values", values, torch.float32, 2)
        self._check("ids", ids, torch.int64, 2)
        assert values.shape == ids.shape == (num_rows, k) and values.is_contiguous() and ids.is_contiguous()
        self._rows("top_log_probs", num_rows, vocab, (c_ptr(values), c_ptr(ids), c_ptr(logits), c_int(k), c_int(vocab),
                                                      c_long_long(logits.stride(0))), logits.device)

    def beam_candidates(self, log_probs: torch.Tensor, running_scores: torch.Tensor, num_candidates: int,
                        diversity_rate: float, scores: torch.Tensor, parents: torch.Tensor,
                        tokens: torch.Tensor) -> None:
        """log_probs float32 [K, V] (contiguous), running_scores float32 [K] -> the num_candidates
        (<= K * V) best: scores float32, parents int64, tokens int64 [num_candidates], best first."""
        self._check("log_probs", log_probs, torch.float32, 2)
        assert log_probs.is_contiguous(), "log_probs: must be contiguous"
        num_beams, vocab = log_probs.shape
        self._vectors(num_beams, torch.float32, running_scores=running_scores)
        assert 0 <= num_candidates <= num_beams * vocab, (num_candidates, num_beams, vocab)
        self._vectors(num_candidates, torch.float32, scores=scores)
        self._vectors(num_candidates, torch.int64, parents=parents, tokens=tokens)
        if num_candidates == 0:
            return
        per_beam = min(num_candidates, vocab)
        # NOTE: freed on return; safe, torch's allocator is ordered on this stream
        cand_scores = torch.empty(num_beams, per_beam, dtype=torch.float32, device=log_probs.device)
        cand_tokens = torch.empty(num_beams, per_beam, dtype=torch.int32, device=log_probs.device)
        self._rows("beam_topk_per_beam", num_beams, vocab, (c_ptr(cand_scores), c_ptr(cand_tokens), c_ptr(log_probs),
                                                            c_ptr(running_scores), c_int(vocab), c_int(per_beam)),
                   log_probs.device)
        self._rows("beam_select", 1, num_beams * per_beam,
                   (c_ptr(scores), c_ptr(parents), c_ptr(tokens), c_ptr(cand_scores), c_ptr(cand_tokens),
                    c_int(num_beams), c_int(per_beam), c_int(num_candidates), c_float(diversity_rate)), log_probs.device)
