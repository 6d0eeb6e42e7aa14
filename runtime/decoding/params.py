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
- min_p (Nguyen et al. 2024) removes the tokens whose probability is below min_p times the top
  token's, after temperature and the penalties, before top-k / top-p.
- num_top_log_probs k: with each generated token, the k most likely tokens and their log probs
  under the model's own distribution (the raw logits' log softmax, before any processing, as the
  OpenAI API reports them); beam width 1 and one sequence.
- num_return_sequences n: n independent samples sharing the prompt's KV; sample i draws as a
  request with seed random_seed + i would (runtime/decoding/samples.py).
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
from typing import Mapping

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
    if any(o != -1 for o in offsets[len(ends):]):   # -1 is the only padding: [-7, -1] is no word list
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
    min_p: float = 0.0
    num_top_log_probs: int = 0
    num_return_sequences: int = 1     # independent samples of the prompt (beam width 1; samples.py)
    min_length: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    no_repeat_ngram_size: int = 0
    length_penalty: float = 0.0
    early_stopping: int = 1
    diversity_rate: float = 0.0
    random_seed: int = 0
    end_id: int | None = None      # None: never stop on a token
    normalize_log_probs: bool = True
    bad_words: WordList = ()
    stop_words: WordList = ()
    embedding_bias: torch.Tensor | None = field(default=None, compare=False)  # float32 [V]
    # External draft tokens of a sampled request: their draft model's logits float32 [D, V] (else a
    # draft is taken as certain: q one-hot), and TensorRT-LLM's constant acceptance threshold.
    draft_logits: torch.Tensor | None = field(default=None, compare=False)
    draft_acceptance_threshold: float | None = None
    # Guided decoding: the compiled grammar (guided.Template), or a Future of it; a request is
    # decoded only once it is done.
    guide: object = field(default=None, compare=False)

    @property
    def is_beam_search(self) -> bool:
        return self.beam_width > 1

    @property
    def num_sequences(self) -> int:
        """Output sequences: the beams, or the independent samples."""
        return max(self.beam_width, self.num_return_sequences)

    @property
    def is_greedy(self) -> bool:
        return (self.beam_width == 1 and
                (self.temperature == 0 or self.top_k == 1 or (self.top_k == 0 and self.top_p == 0)))

    @property
    def is_plain_greedy(self) -> bool:
        """Greedy with nothing between the model's logits and the pick: no penalty, ban, guide,
        top log probs or external drafts. Such a request's token is the argmax of its row, so
        several generation steps may run in one call (runtime.ModelRunner.decode_greedy)."""
        return (self.is_greedy and self.num_return_sequences == 1 and not self.needs_penalties
                and not self.bad_words and not self.no_repeat_ngram_size and self.guide is None
                and not self.num_top_log_probs and self.draft_logits is None)

    @property
    def needs_penalties(self) -> bool:
        """True when the bias/temperature/penalty kernel changes this request's logits."""
        return (self.embedding_bias is not None or self.temperature not in (0.0, 1.0)
                or self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0 or (self.min_length > 0 and self.end_id is not None))

    def validate(self, vocab_size: int, max_beam_width: int, names: Mapping[str, str] | None = None) -> None:
        """The one validator of decoding settings (GptManager's request tensors, GptSession's and
        the Executor's SamplingConfig all convert into DecodingParams, then call this). Raises
        ValueError "<name>: <value> ..." for the first bad field; `names` maps a field to the name
        the caller's user knows (a tensor name, say)."""
        def fail(name: str, what: str):
            raise ValueError(f"{(names or {}).get(name, name)}: {getattr(self, name)!r} {what}")

        bounds = dict(_BOUNDS, beam_width=(1, max_beam_width), top_p_reset_id=(-1, vocab_size - 1),
                      num_top_log_probs=(0, min(64, vocab_size)))
        for name, (low, high, *open_ends) in bounds.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                fail(name, "must be a finite number")
            if name in _INTEGER_FIELDS and not isinstance(value, int):
                fail(name, "must be an integer")
            low_open, high_open = (open_ends + [False, False])[:2]
            if value < low or value > high or (low_open and value == low) or (high_open and value == high):
                fail(name, f"outside {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}")
        if self.num_return_sequences > 1 and self.beam_width > 1:
            fail("num_return_sequences", f"needs beam width 1, got {self.beam_width}")
        if self.num_top_log_probs and self.num_sequences > 1:
            fail("num_top_log_probs", f"needs beam width 1, got {self.beam_width}")
        if self.end_id is not None and not (isinstance(self.end_id, int) and 0 <= self.end_id < vocab_size):
            fail("end_id", f"outside [0, {vocab_size}) (None: no end id)")
        threshold = self.draft_acceptance_threshold
        if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))
                                      or not 0.0 <= threshold < math.inf):
            name = (names or {}).get("draft_acceptance_threshold", "draft_acceptance_threshold")
            raise ValueError(f"{name}: must be a finite number >= 0, got {threshold!r}")
        if self.embedding_bias is not None:
            bias = self.embedding_bias
            name = (names or {}).get("embedding_bias", "embedding_bias")
            if bias.shape != (vocab_size,) or not bias.dtype.is_floating_point:
                raise ValueError(f"{name}: expected float [{vocab_size}], got {bias.dtype} {list(bias.shape)}")
            if not bool(torch.isfinite(bias).all()):
                raise ValueError(f"{name}: must be finite (NaN or inf found)")


# field -> (low, high[, low open[, high open]]): the ranges of every numeric setting.
_BOUNDS = {
    "temperature": (0.0, 1e4), "top_k": (0, 1 << 20), "top_p": (0.0, 1.0), "top_p_decay": (0.0, 1.0, True),
    "top_p_min": (0.0, 1.0, True), "min_length": (0, 1 << 30), "repetition_penalty": (0.0, 1e4, True),
    "presence_penalty": (-1e4, 1e4), "frequency_penalty": (-1e4, 1e4), "no_repeat_ngram_size": (0, 1 << 20),
    "length_penalty": (-1e4, 1e4), "early_stopping": (-(1 << 31), (1 << 31) - 1), "diversity_rate": (0.0, 1e4),
    "random_seed": (0, (1 << 64) - 1), "min_p": (0.0, 1.0), "num_top_log_probs": (0, 64),
    "num_return_sequences": (1, 64),
}
_INTEGER_FIELDS = {"beam_width", "top_k", "top_p_reset_id", "min_length", "no_repeat_ngram_size",
                   "early_stopping", "random_seed", "num_top_log_probs", "num_return_sequences"}
