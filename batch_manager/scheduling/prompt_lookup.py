"""The built-in drafter: prompt lookup (n-gram matching against the request's own tokens; Saxena
2023, "prompt lookup decoding"). Needs no second model; pays off when the output copies spans of
the prompt (extraction, summaries, code edits). Plain Python on the token list."""
from __future__ import annotations


def propose_drafts(tokens: list[int], num_draft_tokens: int, max_ngram_size: int) -> list[int]:
    """Up to `num_draft_tokens` tokens continuing `tokens` (prompt + generated): find the most
    recent earlier occurrence of the longest suffix n-gram (n from max_ngram_size down to 1) and
    propose what followed it. [] when nothing matches."""
    length = len(tokens)
    backwards = tokens[::-1]   # list.index (C speed) on the reversed list finds the latest occurrence
    for n in range(min(max_ngram_size, length - 1), 0, -1):
        pattern = tokens[length - n:]
        start = length - n - 1   # candidate starts, right to left, before the suffix itself
        while start >= 0:
            try:
                start = length - 1 - backwards.index(pattern[0], length - 1 - start)
            except ValueError:
                break
            if tokens[start:start + n] == pattern:
                return tokens[start + n:start + n + num_draft_tokens]
            start -= 1
    return []
