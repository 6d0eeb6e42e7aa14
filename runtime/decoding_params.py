"""One request's decoding settings (`DecodingParams`), their validation, and the word-list format.

Semantics, chosen to match TensorRT-LLM (the system this runtime clones) and stated once here:
- Greedy when beam_width is 1 and top_k is 1, or top_k and top_p are both 0, or temperature is 0.
- Logits processing order: embedding bias, temperature (logits / temperature), repetition penalty
  (positive logits divided, negative multiplied), presence penalty (minus once per distinct token),
  frequency penalty (minus per occurrence), the min-length ban of the end id, then bad words and
  no-repeat n-grams. Penalties count the prompt and the generated tokens (TensorRT-LLM; Hugging
  Face's repetition penalty does the same; OpenAI-style presence/frequency count only outputs).
  Temperature comes before the penalties (Hugging Face applies the repetition penalty first; the
  two orders agree when temperature is 1).
- min_length counts generated tokens (Hugging Face's `min_new_tokens`).
- Top-k keeps exactly k tokens (ties at the k-th place broken by the lower token id); top-p keeps
  the smallest most-probable prefix of those whose mass reaches p (Hugging Face's warpers: p is
  relative to the top-k mass). top_p decays after each step, p <- max(p * top_p_decay, top_p_min),
  and resets to its initial value when the sampled token is top_p_reset_id.
- Log probs are taken after processing: normalize_log_probs renormalises over the tokens top-k /
  top-p kept (the distribution actually sampled); otherwise over the whole vocabulary. Greedy and
  beam search keep the whole vocabulary either way. The end token's log prob counts in
  cum_log_probs but has no entry in output_log_probs (the end token is not output).
- Beam search follows Hugging Face's (transformers 5) algorithm: 2 * beam_width candidates, a bank
  of finished hypotheses scored cum_log_prob / generated_len ** length_penalty (the end token
  counted in the length), early_stopping 1 = stop when beam_width hypotheses are finished, 0 = the
  heuristic, any other value = "never". Differences: logits processors run before the log-softmax
  (TensorRT-LLM) rather than after it; the diversity rate (Li et al. 2016, "A simple, fast diverse
  decoding algorithm") lowers the ranking score of the r-th best continuation of each beam by
  diversity_rate * r without changing its cum_log_prob.
- Word lists use TensorRT-LLM's format: int32 [2, L] (or [1, 2, L]), row 0 the words' tokens
  concatenated, row 1 the cumulative end offset of each word, padded with -1: words [[5, 6], [7]]
  are [[5, 6, 7], [2, 3, -1]]. Bad words match the end of the prompt + generated tokens; stop words
  match the end of the generated tokens (so a stop word never fires on the prompt alone).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

WordList = tuple[tuple[int, ...], ...]


def to_word_list(words, width: int | None = None) -> torch.Tensor:
    """Words (lists of token ids) -> int32 [2, L] in the format above; L is at least `width`
    (to stack several lists), else the longer of the two rows."""
    tokens = [t for w in words for t in w]
    offsets, end = [], 0
    for w in words:
        end += len(w)
        offsets.append(end)
    width = max(len(tokens), len(offsets), width or 0)
    return torch.tensor([tokens + [-1] * (width - len(tokens)), offsets + [-1] * (width - len(offsets))],
                        dtype=torch.int32)


def parse_word_list(value, name: str, vocab_size: int) -> WordList:
    """A [2, L] / [1, 2, L] word list (tensor or nested lists) -> tuple of words."""
    if value is None:
        return ()
    t = value if isinstance(value, torch.Tensor) else torch.tensor(value)
    if t.dim() == 3 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 2 or t.shape[0] != 2:
        raise ValueError(f"{name}: expected shape [2, L] or [1, 2, L], got {list(t.shape)}")
    if t.dtype.is_floating_point or t.dtype == torch.bool:
        raise ValueError(f"{name}: expected an integer tensor, got {t.dtype}")
    tokens, offsets = t[0].tolist(), t[1].tolist()
    ends = []
    for offset in offsets:
        if offset < 0:
            break
        ends.append(offset)
    if offsets[len(ends):] and any(o >= 0 for o in offsets[len(ends):]):
        raise ValueError(f"{name}: offsets must be a prefix of non-negative values then -1 padding, got {offsets}")
    words, start = [], 0
    for end in ends:
        if end <= start or end > len(tokens):
            raise ValueError(f"{name}: offsets must increase strictly within the {len(tokens)} tokens, got {ends}")
        word = tuple(tokens[start:end])
        bad = [tok for tok in word if not 0 <= tok < vocab_size]
        if bad:
            raise ValueError(f"{name}: token id {bad[0]} outside [0, {vocab_size})")
        words.append(word)
        start = end
    return tuple(words)


@dataclass(frozen=True)
class DecodingParams:
    beam_width: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    top_p_decay: float = 1.0
    top_p_min: float = 1e-6
    top_p_reset_id: int = -1
    min_length: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    no_repeat_ngram_size: int = 0
    length_penalty: float = 0.0
    early_stopping: int = 1
    diversity_rate: float = 0.0
    random_seed: int = 0
    end_id: int = -1               # -1: never stop on a token
    normalize_log_probs: bool = True
    bad_words: WordList = ()
    stop_words: WordList = ()
    embedding_bias: torch.Tensor | None = field(default=None, compare=False)  # float32 [V]

    @property
    def is_beam_search(self) -> bool:
        return self.beam_width > 1

    @property
    def is_greedy(self) -> bool:
        return (self.beam_width == 1 and
                (self.temperature == 0 or self.top_k == 1 or (self.top_k == 0 and self.top_p == 0)))

    @property
    def needs_penalties(self) -> bool:
        """True when the bias/temperature/penalty kernel changes this request's logits."""
        return (self.embedding_bias is not None or self.temperature not in (0.0, 1.0)
                or self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0 or (self.min_length > 0 and self.end_id >= 0))

    def validate(self, vocab_size: int, max_beam_width: int) -> None:
        """Raise ValueError naming the field and the value of the first bad setting."""
        def check(name: str, ok: bool, what: str):
            if not ok:
                raise ValueError(f"{name}: {what}, got {getattr(self, name)!r}")

        def finite(name: str) -> bool:
            value = getattr(self, name)
            return isinstance(value, (int, float)) and math.isfinite(value)

        check("beam_width", 1 <= self.beam_width <= max_beam_width, f"must be in [1, {max_beam_width}]")
        check("temperature", finite("temperature") and self.temperature >= 0, "must be finite and >= 0")
        check("top_k", 0 <= self.top_k, "must be >= 0")
        check("top_p", finite("top_p") and 0 <= self.top_p <= 1, "must be in [0, 1]")
        check("top_p_decay", finite("top_p_decay") and 0 < self.top_p_decay <= 1, "must be in (0, 1]")
        check("top_p_min", finite("top_p_min") and 0 < self.top_p_min <= 1, "must be in (0, 1]")
        check("top_p_reset_id", -1 <= self.top_p_reset_id < vocab_size, f"must be -1 or in [0, {vocab_size})")
        check("min_length", self.min_length >= 0, "must be >= 0")
        check("repetition_penalty", finite("repetition_penalty") and self.repetition_penalty > 0,
              "must be finite and > 0")
        check("presence_penalty", finite("presence_penalty"), "must be finite")
        check("frequency_penalty", finite("frequency_penalty"), "must be finite")
        check("no_repeat_ngram_size", self.no_repeat_ngram_size >= 0, "must be >= 0")
        check("length_penalty", finite("length_penalty"), "must be finite")
        check("diversity_rate", finite("diversity_rate") and self.diversity_rate >= 0, "must be finite and >= 0")
        check("random_seed", 0 <= self.random_seed < 2 ** 64, "must be in [0, 2^64)")
        check("end_id", -1 <= self.end_id < vocab_size, f"must be -1 or in [0, {vocab_size})")
        if self.embedding_bias is not None:
            bias = self.embedding_bias
            if bias.shape != (vocab_size,) or not bias.dtype.is_floating_point:
                raise ValueError(f"embedding_bias: expected float [{vocab_size}], got {bias.dtype} {list(bias.shape)}")
            if not bool(torch.isfinite(bias).all()):
                raise ValueError("embedding_bias: must be finite (NaN or inf found)")
