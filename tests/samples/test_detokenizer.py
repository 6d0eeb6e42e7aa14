"""samples.serve.detokenizer against its references, property-based: the incremental deltas add up to
the tokenizer's decode of every token and never hold a broken character; stop strings end the text
where a token-by-token search of that text would, and nothing emitted is ever taken back. Over a
byte-level BPE whose CJK and emoji are split over byte tokens, and a word-level tokenizer whose
decode puts spaces between tokens (a decode that depends on the neighbours)."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from samples.serve.detokenizer import IncrementalDetokenizer, TextStream
from tests.samples.scripted_model import VOCAB_SIZE, write_tokenizer

ALPHABET = "ab cd,!漢字かな日本語😀🚀👋é"
SETTINGS = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    import transformers
    directory = str(tmp_path_factory.mktemp("bpe"))
    write_tokenizer(directory)
    return transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)


@pytest.fixture(scope="module")
def word_level(tokenizer_dir):
    from samples.serve.launch import load_tokenizer
    return load_tokenizer(tokenizer_dir)


def deltas(tokenizer, ids: list[int]) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer)
    return [detokenizer.add([t]) for t in ids] + [detokenizer.flush()]


def test_split_characters_are_held_back_until_whole(bpe):
    ids = bpe.encode("a 漢😀", add_special_tokens=False)
    assert len(ids) > 3   # the characters span several byte tokens
    parts = deltas(bpe, ids)
    assert [p for p in parts if p] == ["a", " 漢", "😀"]


def test_a_character_that_never_completes_is_flushed_as_the_decoder_shows_it(bpe):
    ids = bpe.encode("x漢", add_special_tokens=False)[:-1]   # the last byte of 漢 missing
    parts = deltas(bpe, ids)
    assert "".join(parts) == bpe.decode(ids) == "x\ufffd" and parts[-1] == "\ufffd"


@SETTINGS
@given(data=st.data())
def test_deltas_add_up_to_the_decode_and_hold_no_broken_character(bpe, data):
    if data.draw(st.booleans()):
        ids = bpe.encode(data.draw(st.text(ALPHABET, max_size=24)), add_special_tokens=False)
    else:   # any tokens: lone continuation bytes and special tokens too
        ids = data.draw(st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=24))
    parts = deltas(bpe, ids)
    full = bpe.decode(ids, skip_special_tokens=True)
    assert "".join(parts) == full
    if "\ufffd" not in full:
        assert not any("\ufffd" in p for p in parts)


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(3, 127), max_size=16))
def test_word_level_deltas_add_up_to_the_decode(word_level, ids):
    assert "".join(deltas(word_level, ids)) == word_level.decode(ids, skip_special_tokens=True)


def reference_stop(tokenizer, ids: list[int], stop: tuple[str, ...]) -> tuple[str, int, bool]:
    """(text, tokens consumed, stopped): after each token, search the text streamed so far."""
    detokenizer, text = IncrementalDetokenizer(tokenizer), ""
    for k, token in enumerate(ids, 1):
        text += detokenizer.add([token])
        hits = [i for i in (text.find(s) for s in stop) if i >= 0]
        if hits:
            return text[:min(hits)], k, True
    text += detokenizer.flush()
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return (text[:min(hits)], len(ids), True) if hits else (text, len(ids), False)


@SETTINGS
@given(data=st.data())
def test_stop_strings_end_the_text_where_a_token_by_token_search_would(bpe, data):
    text = data.draw(st.text(ALPHABET, min_size=1, max_size=24))
    ids = bpe.encode(text, add_special_tokens=False)
    full = bpe.decode(ids)

    def substring(draw_start: int, length: int) -> str:
        start = draw_start % len(full)
        return full[start:start + length]

    stop = tuple(s for s in data.draw(st.lists(
        st.builds(substring, st.integers(0, 100), st.integers(1, 5)) | st.text(ALPHABET, min_size=1, max_size=3),
        min_size=1, max_size=3)) if s)
    stream, emitted, consumed = TextStream(bpe, stop), "", 0
    expected_text, expected_tokens, expected_stopped = reference_stop(bpe, ids, stop)
    # tokens in random groups, as responses bring them
    i = 0
    while i < len(ids) and not stream.is_stopped:
        n = data.draw(st.integers(1, 3))
        delta = stream.add(ids[i:i + n])
        i += n
        emitted += delta.text
        consumed += delta.num_tokens
        assert expected_text.startswith(emitted)   # nothing sent is ever taken back
        assert all(s not in emitted for s in stop)
    emitted += stream.finish().text
    assert (emitted, stream.is_stopped) == (expected_text, expected_stopped)
    assert consumed == expected_tokens
