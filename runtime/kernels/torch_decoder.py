"""Torch reference of the decoding kernels: logits processing, token bans, greedy and top-k/top-p
sampling, log-softmax. The oracle for the CUDA versions; `TorchKernels` inherits these.

Every operation is row-wise: a row's result depends on that row's inputs only, never on which
other rows share the call (batch invariance). Shapes: logits float32 [R, V]; `rows` int64 [n]
selects the rows an in-place operation touches; per-row parameters are [n].

Semantics (TensorRT-LLM's, documented in runtime/decoder.py): embedding bias, then temperature,
then repetition / presence / frequency penalties counted over prompt and generated tokens, then
the min-length ban of the end id. Top-k keeps exactly k tokens, ties at the k-th place broken by
the lower token id; top-p then keeps the smallest prefix (by probability, ties by token id) of the
top-k tokens whose mass reaches p, renormalised over the top-k mass, as Hugging Face's warpers do.
The draw is an inverse CDF in token-id order: the first token whose cumulative weight exceeds
u * total.
"""
from __future__ import annotations

import torch

NEG_INF = float("-inf")


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.zeros_like(x[:, :1]), x.cumsum(-1)[:, :-1]], dim=-1)


class TorchDecoderKernels:
    def apply_penalties(self, logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor,
                        token_lengths: torch.Tensor, embedding_bias: torch.Tensor | None,
                        temperature: torch.Tensor, repetition_penalty: torch.Tensor,
                        presence_penalty: torch.Tensor, frequency_penalty: torch.Tensor,
                        min_lengths: torch.Tensor, num_generated: torch.Tensor, end_ids: torch.Tensor) -> None:
        """In place on logits[rows]. token_ids int64 [n, L] (prompt + generated, padded),
        token_lengths [n]; embedding_bias float32 [n, V] or None; temperature > 0; end_ids [n]
        (-1: none): the end id is banned while num_generated < min_lengths."""
        if rows.numel() == 0:
            return
        sub = logits[rows]
        if embedding_bias is not None:
            sub += embedding_bias
        sub /= temperature[:, None]
        valid = torch.arange(token_ids.shape[1], device=sub.device)[None, :] < token_lengths[:, None]
        counts = torch.zeros_like(sub).scatter_add_(1, token_ids, valid.to(sub.dtype))  # [n, V]
        seen = counts > 0
        rep = repetition_penalty[:, None]
        penalised = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, penalised, sub)
        sub -= presence_penalty[:, None] * seen
        sub -= frequency_penalty[:, None] * counts
        ban_end = (num_generated < min_lengths) & (end_ids >= 0)
        if bool(ban_end.any()):
            sub[ban_end.nonzero()[:, 0], end_ids[ban_end]] = NEG_INF
        logits[rows] = sub

    def ban_tokens(self, logits: torch.Tensor, row_ids: torch.Tensor, token_ids: torch.Tensor) -> None:
        """logits[row_ids[i], token_ids[i]] = -inf for every pair i (int64 [m] each)."""
        if row_ids.numel():
            logits[row_ids, token_ids] = NEG_INF

    @staticmethod
    def repeat_ngram_bans(tokens: torch.Tensor, ngram_size: int) -> torch.Tensor:
        """tokens int64 [L] (one sequence) -> the token ids that would repeat an n-gram of it."""
        n = ngram_size
        if n <= 0 or tokens.numel() < n:
            return tokens.new_zeros(0)
        if n == 1:
            return tokens.unique()
        grams = tokens.unfold(0, n, 1)  # [L - n + 1, n]
        match = (grams[:, :-1] == tokens[-(n - 1):]).all(dim=1)
        return grams[match, -1].unique()

    def greedy(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (tokens int64 [R]: first maximum, log_probs float32 [R] over the whole vocabulary)."""
        tokens = logits.argmax(dim=-1)
        log_probs = logits.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)
        return tokens, log_probs

    def log_softmax(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(logits, dim=-1)

    def top_k_top_p_mask(self, logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        """bool [R, V]: the tokens sampling may draw. top_k int64 [R] (0: off), top_p float32 [R]
        (<= 0 or >= 1: off)."""
        num_rows, vocab = logits.shape
        kept = torch.ones_like(logits, dtype=torch.bool)
        k_rows = (top_k > 0).nonzero()[:, 0]
        if k_rows.numel():
            sub, k = logits[k_rows], top_k[k_rows].clamp(max=vocab)
            kth = sub.topk(int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])  # [n, 1]
            greater, equal = sub > kth, sub == kth
            need = k - greater.sum(-1)
            kept[k_rows] = greater | (equal & (equal.cumsum(-1) <= need[:, None]))
        p_rows = ((top_p > 0) & (top_p < 1)).nonzero()[:, 0]
        if p_rows.numel():
            sub = logits[p_rows].masked_fill(~kept[p_rows], NEG_INF)
            k = top_k[p_rows]
            if bool((k > 0).all()):
                # Only the top-k tokens can survive: order those instead of the whole vocabulary.
                values, index = sub.topk(int(k.clamp(max=vocab).max()), dim=-1)
                order = index.argsort(dim=-1)
                values, index = values.gather(1, order), index.gather(1, order)
            else:
                values, index = sub, torch.arange(vocab, device=sub.device).expand_as(sub)
            order = values.argsort(dim=-1, descending=True, stable=True)  # ties: lower token id first
            values, index = values.gather(1, order), index.gather(1, order)
            probs = torch.softmax(values, dim=-1)
            keep_sorted = _exclusive_cumsum(probs) < top_p[p_rows, None]
            keep_sorted[:, 0] = True
            nucleus = torch.zeros_like(sub, dtype=torch.bool).scatter_(1, index, keep_sorted)
            kept[p_rows] &= nucleus
        return kept

    def sample(self, logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor,
               normalize_log_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits float32 [R, V] (processed), uniforms float32 [R] in [0, 1) ->
        (tokens int64 [R], log_probs float32 [R]): the log probability under the top-k/top-p
        renormalised distribution where normalize_log_probs [R] is set, else over the whole vocabulary."""
        vocab = logits.shape[1]
        kept = self.top_k_top_p_mask(logits, top_k, top_p)
        row_max = logits.max(dim=-1, keepdim=True).values
        weights = torch.exp(logits - row_max).masked_fill_(~kept, 0.0)  # [R, V]
        cdf = weights.cumsum(dim=-1)
        total = cdf[:, -1]
        tokens = (cdf <= (uniforms * total)[:, None]).sum(dim=-1)
        # u * total can round up to total: fall back to the last token that has weight.
        last_positive = vocab - 1 - (weights > 0).flip(-1).to(torch.int8).argmax(dim=-1)
        tokens = torch.minimum(tokens, last_positive)
        token_logits = logits.gather(1, tokens[:, None])[:, 0]
        normalised = token_logits - row_max[:, 0] - torch.log(total)
        full = token_logits - torch.logsumexp(logits, dim=-1)
        return tokens, torch.where(normalize_log_probs, normalised, full)
