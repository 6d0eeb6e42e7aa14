"""Torch reference of the decoding operations (logits processing, token bans, greedy and
top-k/top-p sampling, log-softmax, beam candidates) as plain functions: the definitions the CUDA
kernels are tested against. Their contract (shapes, semantics, batch invariance) is stated once,
in interface.py; `TorchKernels` binds them as its decoding ops.
"""
from __future__ import annotations

import torch

from ... import rng
from ..interface import NO_TOKEN

NEG_INF = float("-inf")
_TOP_P_CANDIDATES = (1024, 16384)  # top-p rows draw among this many most probable tokens when they hold p


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.zeros_like(x[:, :1]), x.cumsum(-1)[:, :-1]], dim=-1)


def apply_penalties(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor,
                    token_lengths: torch.Tensor, embedding_bias: torch.Tensor | None,
                    temperature: torch.Tensor, repetition_penalty: torch.Tensor,
                    presence_penalty: torch.Tensor, frequency_penalty: torch.Tensor,
                    min_lengths: torch.Tensor, num_generated: torch.Tensor, end_ids: torch.Tensor) -> None:
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


def ban_tokens(logits: torch.Tensor, row_ids: torch.Tensor, token_ids: torch.Tensor) -> None:
    """logits[row_ids[i], token_ids[i]] = -inf for every pair i (int64 [m] each)."""
    if row_ids.numel():
        logits[row_ids, token_ids] = NEG_INF


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


def uniforms(seeds: torch.Tensor, steps: torch.Tensor, beams: torch.Tensor) -> torch.Tensor:
    draws = rng.uniforms([s & 0xFFFFFFFFFFFFFFFF for s in seeds.tolist()], steps.tolist(), beams.tolist())
    return torch.from_numpy(draws).to(seeds.device)


def beam_candidates(log_probs: torch.Tensor, running_scores: torch.Tensor, num_candidates: int,
                    diversity_rate: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    num_beams, vocab = log_probs.shape
    num_candidates = min(num_candidates, num_beams * vocab)
    scores = log_probs + running_scores[:, None]
    if diversity_rate == 0:
        values, flat = scores.reshape(-1).topk(num_candidates)
        return values, flat // vocab, flat % vocab
    per_beam = min(num_candidates, vocab)
    values, index = scores.topk(per_beam, dim=-1)  # [num_beams, per_beam], best first per beam
    ranked = values - diversity_rate * torch.arange(per_beam, dtype=values.dtype, device=values.device)[None, :]
    _, flat = ranked.reshape(-1).topk(num_candidates)
    return values.reshape(-1)[flat], flat // per_beam, index.reshape(-1)[flat]


def greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (tokens int64 [R]: first maximum, log_probs float32 [R] over the whole vocabulary);
    NO_TOKEN and -inf for a row with no allowed token."""
    tokens = logits.argmax(dim=-1)
    log_probs = logits.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)
    return _mark_empty_rows(logits, tokens, log_probs)


def _empty_rows(logits: torch.Tensor) -> torch.Tensor:
    """bool [R]: rows with no allowed token (every logit -inf or NaN)."""
    return ~(logits > NEG_INF).any(dim=-1)


def _mark_empty_rows(logits: torch.Tensor, tokens: torch.Tensor,
                     log_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows with no allowed token draw nothing: NO_TOKEN, log prob -inf (never token 0)."""
    empty = _empty_rows(logits)
    if bool(empty.any()):
        tokens[empty], log_probs[empty] = NO_TOKEN, NEG_INF
    return tokens, log_probs


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, dim=-1)


def top_k_top_p_mask(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
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


def sample(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor,
           normalize_log_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NOTE: the result equals `sample_masked` (the definition) row for row; the fast paths only
    avoid whole-vocabulary passes: a top-k row draws among its k candidates (exact unless
    the k-th value is tied, then it takes the masked path), a top-p row among the 1024 (else
    16384) most probable tokens when they hold at least p of the mass. A row with no allowed
    token (every logit -inf) draws nothing: NO_TOKEN, log prob -inf."""
    tokens = torch.full((logits.shape[0],), NO_TOKEN, dtype=torch.int64, device=logits.device)
    log_probs = torch.full((logits.shape[0],), NEG_INF, dtype=torch.float32, device=logits.device)
    empty = _empty_rows(logits)
    if bool(empty.any()):
        drawn = (~empty).nonzero()[:, 0]
        if drawn.numel():
            tokens[drawn], log_probs[drawn] = sample(logits[drawn], top_k[drawn], top_p[drawn], uniforms[drawn],
                                                     normalize_log_probs[drawn])
        return tokens, log_probs
    vocab = logits.shape[1]
    is_top_k = top_k > 0
    is_top_p = ~is_top_k & (top_p > 0) & (top_p < 1)
    slow = ~is_top_k & ~is_top_p
    k_rows = is_top_k.nonzero()[:, 0]
    if k_rows.numel():
        sub, k = logits[k_rows], top_k[k_rows].clamp(max=vocab)
        values, index = sub.topk(int(k.max()), dim=-1)
        kth = values.gather(1, (k - 1)[:, None])
        exact = (sub >= kth).sum(-1) == k  # no tie at the k-th place
        # ...or a tie among -inf logits only (fewer than k tokens allowed, as under a guide's
        # mask): the tied tokens have no weight, so the candidates draw as the whole row would.
        exact |= (kth[:, 0] == NEG_INF) & (values[:, 0] > NEG_INF)
        valid = torch.arange(values.shape[1], device=sub.device)[None, :] < k[:, None]
        _fast_rows(k_rows, exact, sub, values, index, valid, top_p[k_rows], None, uniforms,
                   normalize_log_probs, tokens, log_probs, slow)
    p_rows = is_top_p.nonzero()[:, 0]
    for num_candidates in _TOP_P_CANDIDATES:  # a partial top-k is far cheaper than a full sort
        if not p_rows.numel():
            break
        sub = logits[p_rows]
        lse = torch.logsumexp(sub, dim=-1)
        values, index = sub.topk(min(vocab, num_candidates), dim=-1)
        p = top_p[p_rows]
        enough = torch.exp(values - lse[:, None]).sum(-1) >= p
        enough &= (sub >= values[:, -1:]).sum(-1) == values.shape[1]  # no tie across the cut
        _fast_rows(p_rows[enough], torch.ones(int(enough.sum()), dtype=torch.bool, device=sub.device),
                   sub[enough], values[enough], index[enough], torch.ones_like(values[enough], dtype=torch.bool),
                   p[enough], lse[enough], uniforms, normalize_log_probs, tokens, log_probs, slow)
        p_rows = p_rows[~enough]
    slow[p_rows] = True
    rest = slow.nonzero()[:, 0]
    if rest.numel():
        t, lp = sample_masked(logits[rest], top_k[rest], top_p[rest], uniforms[rest], normalize_log_probs[rest])
        tokens[rest], log_probs[rest] = t, lp
    return tokens, log_probs


def _fast_rows(rows, ok, sub, values, index, valid, top_p, lse, uniforms, normalize, tokens, log_probs,
               slow) -> None:
    """Draw for rows[ok] among the candidates (values/index [n, C], best first); flag the others slow."""
    slow[rows[~ok]] = True
    pick = ok.nonzero()[:, 0]
    if not pick.numel():
        return
    rows, sub = rows[pick], sub[pick]
    values, index, valid, top_p = values[pick], index[pick], valid[pick], top_p[pick]
    # Ties: lower token id first (topk leaves equal values in any order).
    order = index.argsort(dim=-1)
    values, index, valid = values.gather(1, order), index.gather(1, order), valid.gather(1, order)
    order = values.masked_fill(~valid, float("-inf")).argsort(dim=-1, descending=True, stable=True)
    values, index, valid = values.gather(1, order), index.gather(1, order), valid.gather(1, order)
    masked = values.masked_fill(~valid, NEG_INF)
    if lse is None:  # top-k: top-p is relative to the top-k mass
        probs = torch.softmax(masked, dim=-1)
    else:            # top-p alone: relative to the whole vocabulary
        probs = torch.exp(masked - lse[pick, None])
    p_on = ((top_p > 0) & (top_p < 1))[:, None]
    keep = valid & (~p_on | (_exclusive_cumsum(probs) < top_p[:, None]))
    keep[:, 0] = True
    # The draw runs in token-id order over the kept candidates (as over the whole vocabulary).
    by_id = index.masked_fill(~keep, sub.shape[1]).argsort(dim=-1)
    ids, kept_logits, kept = index.gather(1, by_id), masked.gather(1, by_id), keep.gather(1, by_id)
    row_max = values[:, :1]
    weights = torch.exp(kept_logits - row_max).masked_fill_(~kept, 0.0)
    cdf = weights.cumsum(dim=-1)
    total = cdf[:, -1]
    position = (cdf <= (uniforms[rows] * total)[:, None]).sum(dim=-1)
    last_positive = weights.shape[1] - 1 - (weights > 0).flip(-1).to(torch.int8).argmax(dim=-1)
    position = torch.minimum(position, last_positive)
    token_logits = kept_logits.gather(1, position[:, None])[:, 0]
    tokens[rows] = ids.gather(1, position[:, None])[:, 0]
    normalised = token_logits - row_max[:, 0] - torch.log(total)
    want_full = ~normalize[rows]
    result = normalised.clone()
    if bool(want_full.any()):
        full_lse = lse[pick] if lse is not None else torch.logsumexp(sub[want_full], dim=-1)
        full = token_logits[want_full] - (full_lse[want_full] if lse is not None else full_lse)
        result[want_full] = full
    log_probs[rows] = result


def sample_masked(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor,
                  normalize_log_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition, over the whole vocabulary: the first token (in id order) whose
    cumulative kept weight exceeds u * total; NO_TOKEN (log prob -inf) where no token is allowed."""
    vocab = logits.shape[1]
    kept = top_k_top_p_mask(logits, top_k, top_p)
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
    if not bool(normalize_log_probs.all()):
        full = token_logits - torch.logsumexp(logits, dim=-1)
        normalised = torch.where(normalize_log_probs, normalised, full)
    return _mark_empty_rows(logits, tokens, normalised)


# byte value -> its 8 bits, low bit first, as "banned" flags (a clear bit bans the token)
_BANNED_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1) == 0


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Guided decoding: logits float32 [R, V], in rows `rows` (int64 [n]) -inf for every token v
    whose bit (v % 32) of bitmask[i, v // 32] (int32 [n, >= ceil(V / 32)]) is clear."""
    vocab = logits.shape[1]
    # little-endian words: byte k of word w holds the bits of tokens 32w + 8k .. 32w + 8k + 7
    as_bytes = bitmask.contiguous().view(torch.uint8).to(device="cpu", dtype=torch.int64)
    banned = _BANNED_BITS[as_bytes].reshape(bitmask.shape[0], -1)[:, :vocab].to(logits.device)
    sub = logits.index_select(0, rows)
    sub.masked_fill_(banned, NEG_INF)
    logits.index_copy_(0, rows, sub)


def apply_min_p(logits: torch.Tensor, rows: torch.Tensor, min_p: torch.Tensor) -> None:
    """min-p: in rows `rows` (int64 [n]), -inf for tokens whose probability is below min_p[i]
    (float32 [n]) times the row's top probability: exp(x - max) < min_p. A row of -inf stays."""
    sub = logits[rows]
    row_max = sub.max(dim=-1, keepdim=True).values
    drop = (torch.exp(sub - row_max) < min_p[:, None]) & torch.isfinite(row_max)
    logits[rows] = sub.masked_fill(drop, NEG_INF)


def top_log_probs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (values float32 [R, k], ids int64 [R, k]): each row's k largest log-softmax values,
    descending, ties to the lower id."""
    log_probs = torch.log_softmax(logits, dim=-1)
    values, ids = log_probs.sort(dim=-1, descending=True, stable=True)
    return values[:, :k].contiguous(), ids[:, :k].contiguous()
