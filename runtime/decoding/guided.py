"""Guided decoding through llguidance: grammars (JSON schema, regex, Lark / GBNF) compiled into
token matchers off the worker's thread, and each request's matcher state, whose next-token
bitmask the decoder applies to the processed logits before choosing.

Compilation: `GrammarCompiler.compile` returns a Future at once; a few daemon threads build the
matcher (llguidance compiles the lexer and grammar for the tokenizer) and an LRU cache keyed by
(type, guide text) hands the same compiled template to later requests, each of which works on its
own deep copy. A bad guide fails its Future with a ValueError naming the field. At most
`max_queued` compiles wait or run at once (past it `GrammarQueueFullError`, naming the field);
`shutdown` fails the waiting ones and returns at once (a compile in flight cannot be interrupted:
its daemon thread finishes it and drops the result, and never holds up the process's exit).

Ends: the end tokens (the tokenizer's stop tokens and the request's end id) are allowed exactly
where the grammar is complete; the decoder ends the request there (finish reason "end_id", the
token not output). Where the grammar cannot go on (llguidance's error state, whose mask holds the
stop token alone) nothing is allowed, and the decoder reports that step. A guide whose very first
mask is empty matches no string: compiling refuses it. Beam search keeps one matcher per live
beam (forked with the beams); draft tokens are fed to the matcher to mask each verification row,
then rolled back, and only the accepted tokens stay.
"""
from __future__ import annotations

import collections
import threading
from collections import OrderedDict
from concurrent.futures import Future

import torch

# GuideType value -> llguidance grammar format
GRAMMAR_FORMATS = {"json": "json_schema", "json_schema": "json_schema", "regex": "regex",
                   "ebnf_grammar": "grammar"}
ANY_JSON_OBJECT = '{"type": "object"}'
MAX_QUEUED_COMPILES = 64     # compiles waiting or running at once, per compiler
SHUT_DOWN = "guided_decoding_params: the grammar compiler is shut down"


class GrammarQueueFullError(ValueError):
    """Too many compiles wait already: a refusal for load, naming the field."""


def _llguidance():
    try:
        import llguidance
        import llguidance.torch  # noqa: F401 - the bitmask helpers
    except ImportError as e:   # pragma: no cover - a dependency of the package
        raise RuntimeError("guided decoding needs the llguidance package (pip install llguidance)") from e
    return llguidance


def make_tokenizer(tokenizer_str: str, vocab_size: int, stop_token_ids: list[int] | None = None):
    """An llguidance tokenizer from a Hugging Face tokenizer.json text, over the model's vocabulary
    (ids past the tokenizer's are never allowed)."""
    llguidance = _llguidance()
    eos = stop_token_ids[0] if stop_token_ids else None
    try:
        return llguidance.LLTokenizer(tokenizer_str, n_vocab=vocab_size, eos_token=eos)
    except Exception as e:  # noqa: BLE001 - llguidance's own error types
        raise ValueError(f"GuidedDecodingConfig.tokenizer_str: not a usable tokenizer.json ({e})") from None


class GrammarCompiler:
    """Compiles guides into matcher templates on `max_workers` daemon threads, at most `max_queued`
    waiting or running, caching `cache_size`."""

    def __init__(self, tokenizer, stop_token_ids: list[int] | None = None, max_workers: int = 2,
                 cache_size: int = 256, max_queued: int = MAX_QUEUED_COMPILES):
        self.tokenizer = tokenizer
        self.stop_token_ids = frozenset(stop_token_ids or [tokenizer.eos_token])
        self.cache_size, self.max_queued = cache_size, max_queued
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._waiting: collections.deque[tuple[Future, str, str]] = collections.deque()
        self._num_running = 0
        self._is_shut_down = False
        self.worker_threads = [threading.Thread(target=self._work, name=f"grammar-{i}", daemon=True)
                               for i in range(max_workers)]
        for thread in self.worker_threads:
            thread.start()

    @property
    def num_queued(self) -> int:
        """Compiles waiting or running."""
        with self._lock:
            return len(self._waiting) + self._num_running

    def compile(self, guide_type: str, guide: str | None) -> Future:
        """-> Future of a compiled matcher template (ValueError naming the field on a bad guide).
        GrammarQueueFullError past max_queued compiles; RuntimeError after shutdown."""
        text = ANY_JSON_OBJECT if guide_type == "json" and not guide else guide
        key = (guide_type, text)
        with self._lock:
            if self._is_shut_down:
                raise RuntimeError(SHUT_DOWN)
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            if len(self._waiting) + self._num_running >= self.max_queued:
                raise GrammarQueueFullError(f"guided_decoding_params: {self.max_queued} grammars are being compiled "
                                            f"already (the compiler's limit): try again shortly")
            future = Future()
            self._waiting.append((future, guide_type, text))
            self._cache[key] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            self._wake.notify()
        return future

    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._waiting and not self._is_shut_down:
                    self._wake.wait()
                if self._is_shut_down:
                    return
                future, guide_type, text = self._waiting.popleft()
                self._num_running += 1
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(self._compile(guide_type, text))
                    except BaseException as e:  # noqa: BLE001 - the request's error
                        future.set_exception(e)
            finally:
                with self._lock:
                    self._num_running -= 1

    def _compile(self, guide_type: str, text: str):
        llguidance = _llguidance()
        try:
            grammar = llguidance.grammar_from(GRAMMAR_FORMATS[guide_type], text)
            matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        except Exception as e:  # noqa: BLE001 - a guide that does not parse
            raise ValueError(f"guided_decoding_params.guide: cannot compile the {guide_type} guide ({e})") from None
        if matcher.is_error():
            raise ValueError(f"guided_decoding_params.guide: cannot compile the {guide_type} guide "
                             f"({matcher.get_error()})")
        why = self._matches_nothing(matcher)
        if why is not None:
            raise ValueError(f"guided_decoding_params.guide: the {guide_type} guide matches no string ({why})")
        return Template(matcher, self.stop_token_ids)

    def _matches_nothing(self, matcher) -> str | None:
        """Why no string completes the guide, where its first mask shows it (no token can start it
        and the empty string is not complete); else None. Some such guides only show it later
        (`start: "a" start`): those requests end at the step where nothing is allowed."""
        probe = matcher.deep_copy()
        bitmask = torch.zeros(1, bitmask_words(self.tokenizer.vocab_size), dtype=torch.int32)
        _llguidance().torch.fill_next_token_bitmask(probe, bitmask, 0)
        if probe.is_error():
            return f"llguidance: {probe.get_error().splitlines()[0]}"
        if probe.is_accepting():
            return None
        for token in self.stop_token_ids:
            _set_bit(bitmask[0], token, False)
        return None if bool(bitmask.any()) else "no token can start it"

    def shutdown(self) -> None:
        """Fail the waiting compiles and return at once; a compile in flight finishes on its daemon
        thread, its result unused."""
        with self._lock:
            self._is_shut_down = True
            waiting, self._waiting = list(self._waiting), collections.deque()
            self._cache.clear()
            self._wake.notify_all()
        for future, _, _ in waiting:
            if future.set_running_or_notify_cancel():
                future.set_exception(RuntimeError(SHUT_DOWN))


class Template:
    """A compiled guide; `start()` gives a request its own matcher state."""

    def __init__(self, matcher, stop_token_ids: frozenset[int]):
        self.matcher, self.stop_token_ids = matcher, stop_token_ids

    def start(self) -> "Guide":
        return Guide([self.matcher.deep_copy()], self.stop_token_ids)


class Guide:
    """A request's matcher state, one matcher per live beam."""

    def __init__(self, matchers: list, stop_token_ids: frozenset[int]):
        self.matchers, self.stop_token_ids = matchers, stop_token_ids

    def fill_bitmask(self, bitmask: torch.Tensor, first: int, beam: int, drafts: tuple[int, ...] = (),
                     end_id: int | None = None) -> None:
        """bitmask int32 [rows, words]: row first + j <- the tokens allowed after drafts[:j], for
        j = 0..len(drafts) (past a draft the grammar refuses, rows stay all-allowed: that draft is
        rejected at its own row anyway). The end tokens (stop tokens, `end_id`) are allowed
        exactly where the grammar is complete."""
        llguidance = _llguidance()
        matcher = self.matchers[beam]
        consumed = 0
        for j in range(len(drafts) + 1):
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, first + j)
            complete = matcher.is_accepting() and not matcher.is_error()
            for token in self.stop_token_ids | ({end_id} if end_id is not None else set()):
                _set_bit(bitmask[first + j], token, complete)
            # try_consume_tokens leaves the matcher as it was for a refused token (consume_token
            # would put it in its error state)
            if j == len(drafts) or matcher.try_consume_tokens([drafts[j]]) != 1:
                break
            consumed += 1
        if consumed:
            matcher.rollback(consumed)

    def ends(self, beam: int, token: int) -> bool:
        """Whether `token` is a stop token the grammar allows now (the guide is complete)."""
        return token in self.stop_token_ids and self.matchers[beam].is_accepting()

    def consume(self, beam: int, tokens) -> None:
        for token in tokens:
            self.matchers[beam].consume_token(token)

    def fork(self, parents: list[int], tokens: list[int]) -> None:
        """Beam search: new live beam b continues beam parents[b] with tokens[b]."""
        matchers = []
        for parent, token in zip(parents, tokens):
            m = self.matchers[parent].deep_copy()
            m.consume_token(token)
            matchers.append(m)
        self.matchers = matchers


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


def _set_bit(row: torch.Tensor, token: int, allowed: bool) -> None:
    """row int32 [words] (llguidance's layout: token t is bit t % 32 of word t // 32), in place."""
    word, bit = divmod(token, 32)
    if not 0 <= word < row.shape[0]:
        return
    value = int(row[word]) & 0xFFFFFFFF
    value = value | (1 << bit) if allowed else value & ~(1 << bit)
    row[word] = value - (1 << 32) if value >= 1 << 31 else value
