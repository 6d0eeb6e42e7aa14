"""runtime.decoding.guided's compile queue: bounded (a refusal naming the field past it, cache hits
still served), and a shutdown that returns while a compile is in flight, failing the waiting ones."""
from __future__ import annotations

import threading
import time

import pytest

from runtime.decoding.guided import GrammarCompiler, GrammarQueueFullError, make_tokenizer
from tests.samples.scripted_model import VOCAB_SIZE, write_tokenizer

SCHEMA = '{"type": "object", "properties": {"a": {"type": "integer"}}}'


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bpe")
    write_tokenizer(str(directory))
    return make_tokenizer((directory / "tokenizer.json").read_text(), VOCAB_SIZE)


class BlockedCompiler(GrammarCompiler):
    """A compiler whose compiles wait for `release` (a compile that takes as long as a test wants)."""

    def __init__(self, *args, **kwargs):
        self.release, self.started = threading.Event(), threading.Semaphore(0)
        super().__init__(*args, **kwargs)

    def _compile(self, guide_type, text):
        self.started.release()
        self.release.wait(60)
        return super()._compile(guide_type, text)


def test_the_queue_is_bounded_and_names_the_field(tokenizer):
    compiler = BlockedCompiler(tokenizer, max_workers=1, max_queued=2)
    try:
        first = compiler.compile("regex", "a+")
        assert compiler.started.acquire(timeout=30)          # running
        second = compiler.compile("regex", "b+")             # waiting
        with pytest.raises(GrammarQueueFullError, match=r"^guided_decoding_params: 2 grammars"):
            compiler.compile("regex", "c+")
        assert compiler.compile("regex", "a+") is first      # a cache hit needs no room
        compiler.release.set()
        first.result(30), second.result(30)
        assert compiler.num_queued == 0
        compiler.compile("json_schema", SCHEMA).result(30)   # room again
    finally:
        compiler.release.set()
        compiler.shutdown()


def test_shutdown_returns_with_a_compile_in_flight_and_fails_the_waiting(tokenizer):
    compiler = BlockedCompiler(tokenizer, max_workers=1)
    in_flight = compiler.compile("regex", "a+")
    assert compiler.started.acquire(timeout=30)
    waiting = compiler.compile("regex", "b+")
    began = time.monotonic()
    compiler.shutdown()
    assert time.monotonic() - began < 10     # does not wait for the compile (blocked for up to 60 s)
    with pytest.raises(RuntimeError, match="shut down"):
        waiting.result(0)
    with pytest.raises(RuntimeError, match="shut down"):
        compiler.compile("regex", "c+")
    assert not in_flight.done() and all(t.daemon for t in compiler.worker_threads)   # never holds up the exit
    compiler.release.set()
    in_flight.result(30)                      # it finishes on its own thread, unused
