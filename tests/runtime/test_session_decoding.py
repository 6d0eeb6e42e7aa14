"""GptSession decoding against transformers' generate: penalties, bans and min length under greedy
decoding, beam search sequences and scores, stop words, log probs, seeded sampling that does not
depend on the batch, and per-field validation errors."""
from __future__ import annotations

import pytest
import torch

from runtime import Engine, GenerationInput, GenerationOutput, GptSession, SamplingConfig, WorldConfig
from runtime.decoding import parse_word_list, to_word_list
from tests.factories import make_checkpoint

MAX_NEW = 12


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    model = make_checkpoint(path, "llama", seed=1)
    engine = Engine.from_dir(path, tokens_per_block=4)
    return engine, model


@pytest.fixture(scope="module")
def session(llama):
    engine, _ = llama
    return GptSession(GptSession.Config(max_batch_size=8, max_beam_width=4, max_sequence_length=64),
                      engine.model_config, WorldConfig(), engine)


PROMPTS = [torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 9, 3)]


def generate(session, prompts, sampling, end_id=-1, max_new=MAX_NEW, **inputs):
    ids = torch.tensor([t for p in prompts for t in p], dtype=torch.int32)
    inp = GenerationInput(end_id=end_id, pad_id=0, ids=ids, lengths=torch.tensor([len(p) for p in prompts]),
                          packed=True, max_new_tokens=max_new, **inputs)
    out = GenerationOutput()
    session.generate(out, inp, sampling)
    return out


def generated(out, i, beam=0, prompt_len=None):
    n = prompt_len if prompt_len is not None else len(PROMPTS[i])
    return out.ids[i, beam, n:out.lengths[i, beam]].tolist()


@torch.no_grad()
def hf_generate(model, prompt, end_id=None, **kwargs):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=end_id,
                         pad_token_id=0, **kwargs)
    tokens = out[0, len(prompt):].tolist()
    return tokens[:tokens.index(end_id)] if end_id is not None and end_id in tokens else tokens


# --- greedy with processors: identical tokens to transformers -------------------------------------

@pytest.mark.parametrize("ours, theirs", [
    (dict(repetition_penalty=1.5), dict(repetition_penalty=1.5)),
    (dict(repetition_penalty=0.7), dict(repetition_penalty=0.7)),
    (dict(no_repeat_ngram_size=2), dict(no_repeat_ngram_size=2)),
    (dict(no_repeat_ngram_size=1), dict(no_repeat_ngram_size=1)),
], ids=["repetition-1.5", "repetition-0.7", "no-repeat-2", "no-repeat-1"])
def test_greedy_processors_match_transformers(session, llama, ours, theirs):
    out = generate(session, PROMPTS, SamplingConfig(**ours))
    for i, p in enumerate(PROMPTS):
        assert generated(out, i) == hf_generate(llama[1], p, **theirs), f"prompt {i}"


def test_bad_words_match_transformers(session, llama):
    plain = [hf_generate(llama[1], p) for p in PROMPTS]
    # Ban the second generated token of prompt 0 alone, and the pair (token 3, token 4) of prompt 1.
    words = [[plain[0][1]], [plain[1][3], plain[1][4]]]
    tokens = [t for w in words for t in w]
    offsets = [1, 3, -1]
    out = generate(session, PROMPTS, SamplingConfig(), bad_words_list=torch.tensor([tokens, offsets]))
    for i, p in enumerate(PROMPTS):
        assert generated(out, i) == hf_generate(llama[1], p, bad_words_ids=words), f"prompt {i}"
    assert generated(out, 0) != plain[0]


def test_min_length_masks_the_end_id_like_min_new_tokens(session, llama):
    plain = hf_generate(llama[1], PROMPTS[0])
    end_id = plain[2]  # greedy would end after 2 tokens
    out = generate(session, PROMPTS, SamplingConfig(min_length=6), end_id=end_id)
    for i, p in enumerate(PROMPTS):
        assert generated(out, i) == hf_generate(llama[1], p, end_id=end_id, min_new_tokens=6), f"prompt {i}"
    assert len(generated(out, 0)) >= 6


# --- beam search ----------------------------------------------------------------------------------

def beam_end_id(session, sampling):
    """A token that ends some beams early: the 5th token of prompt 0's last beam without an end id."""
    out = generate(session, PROMPTS, sampling)
    return generated(out, 0, beam=sampling.beam_width - 1)[4]


@pytest.mark.parametrize("beam_width, length_penalty, early_stopping", [
    (2, 1.0, 1), (3, 0.0, 0), (4, 2.0, 2), (4, 1.0, 0), (3, -0.5, 1)])
def test_beam_search_matches_transformers(session, llama, beam_width, length_penalty, early_stopping):
    sampling = SamplingConfig(beam_width=beam_width, length_penalty=length_penalty, early_stopping=early_stopping)
    end_id = beam_end_id(session, sampling)
    out = generate(session, PROMPTS, sampling, end_id=end_id)
    hf_early = {1: True, 0: False}.get(early_stopping, "never")
    num_ended = 0
    for i, p in enumerate(PROMPTS):
        with torch.no_grad():
            ref = llama[1].generate(torch.tensor([p]), max_new_tokens=MAX_NEW, num_beams=beam_width,
                                    num_return_sequences=beam_width, do_sample=False, length_penalty=length_penalty,
                                    early_stopping=hf_early, eos_token_id=end_id, pad_token_id=0,
                                    output_scores=True, return_dict_in_generate=True)
        for b in range(beam_width):
            theirs = ref.sequences[b, len(p):].tolist()
            ended = end_id in theirs
            theirs = theirs[:theirs.index(end_id)] if ended else theirs
            ours = generated(out, i, beam=b)
            assert ours == theirs, f"prompt {i} beam {b}"
            length = len(ours) + (1 if ended else 0)  # the end token counts in the length
            score = out.cum_log_probs[i, b].item() / length ** length_penalty
            assert score == pytest.approx(ref.sequences_scores[b].item(), abs=1e-4)
            num_ended += ended
    if length_penalty < 2:  # a strong length penalty favours the long, unended hypotheses
        assert num_ended > 0, "the test should cover beams ended by the end id"


def test_beam_search_log_probs_sum_to_cum_log_probs(session):
    out = generate(session, PROMPTS, SamplingConfig(beam_width=3))
    for i in range(len(PROMPTS)):
        for b in range(3):
            n = len(generated(out, i, beam=b))
            assert out.log_probs[i, b, :n].sum().item() == pytest.approx(out.cum_log_probs[i, b].item(), abs=1e-4)
            assert (out.log_probs[i, b, :n] <= 0).all()


def test_diversity_rate_changes_the_beams_but_not_the_log_prob_meaning(session):
    plain = generate(session, PROMPTS[:1], SamplingConfig(beam_width=4))
    diverse = generate(session, PROMPTS[:1], SamplingConfig(beam_width=4, beam_search_diversity_rate=5.0))
    assert diverse.ids.tolist() != plain.ids.tolist()
    n = len(generated(diverse, 0, beam=0))
    assert diverse.log_probs[0, 0, :n].sum().item() == pytest.approx(diverse.cum_log_probs[0, 0].item(), abs=1e-4)
    assert len({tuple(generated(diverse, 0, beam=b)) for b in range(4)}) == 4


# --- stop words, log probs ------------------------------------------------------------------------

def word_list(words):
    return to_word_list(words, width=4)  # one width: per-sequence lists are stacked


def test_stop_words_across_tokens_several_words_and_the_first_token(session, llama):
    plain = [hf_generate(llama[1], p) for p in PROMPTS]
    cases = [
        ([plain[0][3:5]], plain[0][:5]),                        # a two-token word, kept in the output
        ([[999 % 128, 998 % 128], plain[0][2:3]], plain[0][:3]),  # several words, the second fires
        ([plain[0][:1]], plain[0][:1]),                          # a stop word at the first token
    ]
    for words, expected in cases:
        out = generate(session, PROMPTS[:1], SamplingConfig(), stop_words_list=word_list(words))
        assert generated(out, 0) == expected, words
    # Per-sequence lists: [batch, 2, L].
    lists = torch.stack([word_list([plain[0][1:2]]), word_list([plain[1][4:6]]), word_list([[127, 126]])])
    out = generate(session, PROMPTS, SamplingConfig(), stop_words_list=lists)
    assert [generated(out, i) for i in range(3)] == [plain[0][:2], plain[1][:6], plain[2]]


def test_greedy_log_probs_are_transformers_log_softmax(session, llama):
    out = generate(session, PROMPTS[:1], SamplingConfig())
    tokens = PROMPTS[0] + generated(out, 0)
    with torch.no_grad():
        logits = llama[1](torch.tensor([tokens])).logits[0]
    expected = torch.log_softmax(logits, -1)[len(PROMPTS[0]) - 1:-1].gather(1, torch.tensor(tokens[len(PROMPTS[0]):])[:, None])[:, 0]
    torch.testing.assert_close(out.log_probs[0, 0], expected, atol=1e-4, rtol=0)
    assert out.cum_log_probs[0, 0].item() == pytest.approx(expected.sum().item(), abs=1e-3)


# --- sampling -------------------------------------------------------------------------------------

def test_seeded_sampling_does_not_depend_on_the_batch(session):
    target = dict(temperature=0.9, top_k=20, top_p=0.9, random_seed=1234)
    alone = generate(session, [PROMPTS[1]], SamplingConfig(**target))
    others = SamplingConfig(temperature=[1.3, 0.9, 0.5, 0.9], top_k=[0, 20, 5, 20], top_p=[0.7, 0.9, 0.0, 0.9],
                            random_seed=[1, 1234, 3, 1234], repetition_penalty=[1.2, 1.0, 1.0, 1.0])
    batch = generate(session, [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[1]], others)
    mine = generated(alone, 0, prompt_len=len(PROMPTS[1]))
    assert generated(batch, 1, prompt_len=len(PROMPTS[1])) == mine
    assert generated(batch, 3, prompt_len=len(PROMPTS[1])) == mine
    different_seed = generate(session, [PROMPTS[1]], SamplingConfig(**{**target, "random_seed": 99}))
    assert generated(different_seed, 0, prompt_len=len(PROMPTS[1])) != mine


def test_top_p_decay_and_reset(session):
    # Decay to a tiny floor makes sampling greedy after a few steps.
    out = generate(session, PROMPTS[:1], SamplingConfig(top_p=0.99, top_p_decay=0.01, top_p_min=1e-6,
                                                        temperature=2.0, random_seed=5))
    greedy_tail = generate(session, [PROMPTS[0] + generated(out, 0)[:2]], SamplingConfig(temperature=2.0),
                           max_new=MAX_NEW - 2)
    assert generated(out, 0)[2:] == generated(greedy_tail, 0, prompt_len=len(PROMPTS[0]) + 2)


@pytest.mark.parametrize("field, value, message", [
    ("temperature", -1.0, "temperature"), ("top_p", 1.5, "top_p"), ("top_k", -2, "top_k"),
    ("repetition_penalty", 0.0, "repetition_penalty"), ("random_seed", -1, "random_seed"),
    ("length_penalty", float("nan"), "length_penalty"), ("top_p_decay", 0.0, "top_p_decay"),
])
def test_bad_sampling_values_are_refused_naming_the_field(session, field, value, message):
    with pytest.raises(ValueError, match=f"SamplingConfig.{message}"):
        generate(session, PROMPTS[:1], SamplingConfig(**{field: value}))


def test_malformed_word_lists_are_refused(session):
    with pytest.raises(ValueError, match="stop_words_list"):
        generate(session, PROMPTS[:1], SamplingConfig(), stop_words_list=torch.tensor([[1, 2], [3, -1]]))
    with pytest.raises(ValueError, match="bad_words_list.*token id 500"):
        generate(session, PROMPTS[:1], SamplingConfig(), bad_words_list=torch.tensor([[500], [1]]))


def test_word_list_format_round_trips():
    words = ((5, 6), (7,), (1, 2, 3))
    encoded = to_word_list(words)
    assert encoded.tolist() == [[5, 6, 7, 1, 2, 3], [2, 3, 6, -1, -1, -1]]
    assert parse_word_list(encoded, "w", 128) == words
    assert parse_word_list(to_word_list(words, width=9)[None], "w", 128) == words


@pytest.mark.parametrize("offsets", [[-7, -1, -1], [1, -2, -1], [2, -1, -3]])
def test_negative_offsets_other_than_the_padding_are_refused(offsets):
    with pytest.raises(ValueError, match="stop_words_list: offsets"):
        parse_word_list(torch.tensor([[5, 6, 7], offsets]), "stop_words_list", 128)
