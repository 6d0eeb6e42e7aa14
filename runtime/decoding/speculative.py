"""Verifying the draft tokens of a sampled request (greedy requests accept a draft that equals
the argmax; decoder.py does that).

Rejection sampling (Leviathan et al. 2023; Chen et al. 2023): with p_j the distribution the
request samples from after drafts[:j] (its penalties, temperature, top-k and top-p applied) and
q_j the draft distribution, draft d_j is accepted with probability min(1, p_j(d_j) / q_j(d_j));
on rejection the token is drawn from norm(max(0, p_j - q_j)), and after D accepted drafts from
p_D. Each emitted token is then distributed as p exactly. q_j is softmax(draft_logits[j]) when the
request brought its draft model's logits, else one-hot at d_j (a drafter that proposes one token
with certainty: acceptance with probability p_j(d_j), and a rejection draws from p_j without d_j).
With an acceptance threshold t (the Executor's `ExternalDraftTokensConfig.acceptance_threshold`)
the rule is TensorRT-LLM's instead: d_j is accepted when p_j(v) >= t * q_j(v) for every token v.

Draws are counter-based like the rest: the acceptance test of the draft at generated position g
uses `uniforms(seed, g, ACCEPT_STREAM)`, the token drawn at position g (rejection or bonus) uses
`uniforms(seed, g, 0)` as plain sampling does, so results do not depend on the batch.
"""
from __future__ import annotations

import torch

from ..kernels.interface import NO_TOKEN

ACCEPT_STREAM = 1


class DraftVerifier:
    def __init__(self, kernels):
        self.kernels = kernels

    def verify(self, state, drafts: tuple[int, ...], logits: torch.Tensor) -> list[tuple[int, float, bool]]:
        """logits float32 [D + 1, V], processed (penalties, bans) -> the picks to append, as
        (token, log prob, is an accepted draft): accepted drafts, then one drawn token (NO_TOKEN
        where the row has no allowed token)."""
        num_drafts, device = len(drafts), logits.device
        p = state.params
        top_p = [state.top_p]
        for token in drafts:   # the decayed top-p each row would have had
            if p.top_p_decay != 1.0 or p.top_p_reset_id >= 0:
                top_p.append(p.top_p if token == p.top_p_reset_id else max(top_p[-1] * p.top_p_decay, p.top_p_min))
            else:
                top_p.append(top_p[-1])
        top_k = torch.full((num_drafts + 1,), p.top_k, dtype=torch.int64, device=device)
        top_p_column = torch.tensor(top_p, dtype=torch.float32, device=device)
        kept = self.kernels.top_k_top_p_mask(logits, top_k, top_p_column)
        masked = logits.masked_fill(~kept, float("-inf"))
        target = torch.softmax(masked, dim=-1)                          # p_j [D + 1, V]
        normalised = torch.log_softmax(masked, dim=-1)
        full = torch.log_softmax(logits, dim=-1)

        def log_prob(j: int, token: int) -> float:
            return float((normalised if p.normalize_log_probs else full)[j, token])

        positions = torch.arange(state.num_generated, state.num_generated + num_drafts + 1, device=device)
        seeds = torch.full_like(positions, p.random_seed - (1 << 64) if p.random_seed >= 1 << 63 else p.random_seed)
        accept_draws = self.kernels.uniforms(seeds, positions, torch.full_like(positions, ACCEPT_STREAM)).tolist()
        token_draws = self.kernels.uniforms(seeds, positions, torch.zeros_like(positions))
        has_token = (logits > float("-inf")).any(dim=-1).tolist()   # per row: some token is allowed
        picks = []
        for j, draft in enumerate(drafts):
            if not has_token[j]:   # nothing allowed after drafts[:j]: the request ends here
                picks.append((NO_TOKEN, float("-inf"), False))
                return picks
            q = self._draft_probs(state, j, draft, logits.shape[1], device)
            if state.draft_acceptance_threshold is not None:
                accepted = bool((target[j] >= state.draft_acceptance_threshold * q).all())
            else:
                p_d, q_d = float(target[j, draft]), float(q[draft])
                accepted = p_d > 0 and (q_d <= p_d or accept_draws[j] < p_d / q_d)
            if accepted:
                picks.append((draft, log_prob(j, draft), True))
                continue
            residual = (target[j] - q).clamp_(min=0)
            if float(residual.sum()) <= 0:     # p_j == q_j: the rejection cannot happen in exact arithmetic
                residual = target[j]
            # The sampler's own draw over the residual (weights as logits; no top-k / top-p)
            no_k = torch.zeros(1, dtype=torch.int64, device=device)
            no_p = torch.zeros(1, dtype=torch.float32, device=device)
            token = int(self.kernels.sample(torch.log(residual)[None], no_k, no_p, token_draws[j:j + 1],
                                            torch.ones(1, dtype=torch.bool, device=device))[0][0])
            picks.append((token, log_prob(j, token), False))
            return picks
        if not has_token[num_drafts]:
            picks.append((NO_TOKEN, float("-inf"), False))
            return picks
        token, _ = self.kernels.sample(logits[num_drafts:], top_k[num_drafts:], top_p_column[num_drafts:],
                                       token_draws[num_drafts:],
                                       torch.tensor([p.normalize_log_probs], device=device))
        picks.append((int(token[0]), log_prob(num_drafts, int(token[0])), False))
        return picks

    @staticmethod
    def _draft_probs(state, j: int, draft: int, vocab: int, device) -> torch.Tensor:
        if state.draft_logits is not None and j < state.draft_logits.shape[0]:
            return torch.softmax(state.draft_logits[j].to(device, torch.float32), dim=-1)
        q = torch.zeros(vocab, device=device)
        q[draft] = 1.0
        return q

