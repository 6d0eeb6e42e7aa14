"""A small real tokenizer and a tiny LLaMA whose weights script its replies, for the OpenAI
endpoint tests: a byte-level BPE trained with `tokenizers` on a few lines (its few merges leave
CJK and emoji split over several byte tokens), saved as a Hugging Face tokenizer directory with
a chat template in tokenizer_config.json; and a checkpoint, written through transformers' real
save path, whose next token depends only on the last one: every prompt is answered with REPLY,
then one of two equally likely tokens (BRANCH), then the end token.

How the weights script it: hidden_size >= vocab_size and the embedding of token t is the one-hot
e_t; every attention and MLP output projection is zero, so the final RMSNorm sees e_t and gives
sqrt(H) * e_t; lm_head[j, t] = LOGIT / sqrt(H) for each successor j of t. The logits are then
exactly LOGIT for t's successors and 0 for every other token."""
from __future__ import annotations

import json
import os

import torch

LINES = ["Hello world, the batch manager serves every client.",
         "Streaming text: 漢字 and かな, 日本語 too.",
         "Emoji like 😀 and 🚀 take four bytes."]
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
VOCAB_SIZE = 300
HIDDEN_SIZE = 320            # >= VOCAB_SIZE: one-hot embeddings
LOGIT = 30.0                 # a successor's logit (others 0): p(any other token) < VOCAB_SIZE * e^-30
MAX_SEQ_LEN = 1024         # the engine the tests build (long enough for a 900-token disconnect test)
REPLY = "Hello 漢字 😀 world!"
BRANCH = (".", "?")          # after REPLY, one of these (equal logits), then the end token


def write_tokenizer(directory: str) -> None:
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers
    import transformers
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(LINES, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>",
                                                eos_token="</s>")
    fast.save_pretrained(directory)
    path = os.path.join(directory, "tokenizer_config.json")
    with open(path) as f:
        config = json.load(f)
    config["chat_template"] = CHAT_TEMPLATE
    with open(path, "w") as f:
        json.dump(config, f, ensure_ascii=False)


class Script:
    """The token chain the model follows, from the tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.reply_ids = tokenizer.encode(REPLY, add_special_tokens=False)
        self.branch_ids = [tokenizer.encode(b, add_special_tokens=False)[0] for b in BRANCH]
        self.end_id = tokenizer.eos_token_id
        chain = self.reply_ids + self.branch_ids + [self.end_id]
        assert len(chain) == len(set(chain)), "the reply's tokens must be distinct (one successor each)"
        assert len(tokenizer) == VOCAB_SIZE

    def successors(self) -> dict[int, list[int]]:
        """token -> its successors: the reply's chain, both branch tokens after it, the end token
        after them; every other token (the end token too) starts the reply."""
        following = {t: [self.reply_ids[0]] for t in range(VOCAB_SIZE)}
        for a, b in zip(self.reply_ids, self.reply_ids[1:]):
            following[a] = [b]
        following[self.reply_ids[-1]] = list(self.branch_ids)
        for t in self.branch_ids:
            following[t] = [self.end_id]
        return following

    def greedy_ids(self) -> list[int]:
        """The generated tokens of a greedy request (ties go to the lower id), end token excluded."""
        return self.reply_ids + [min(self.branch_ids)]

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def write_scripted_model(directory: str, script: Script) -> None:
    import transformers
    config = transformers.LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=HIDDEN_SIZE, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, intermediate_size=32,
                                      max_position_embeddings=MAX_SEQ_LEN, bos_token_id=1, eos_token_id=script.end_id,
                                      pad_token_id=0, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for norm in (model.model.norm, model.model.layers[0].input_layernorm,
                     model.model.layers[0].post_attention_layernorm):
            norm.weight.fill_(1.0)
        model.model.embed_tokens.weight[:, :VOCAB_SIZE] = torch.eye(VOCAB_SIZE)
        for t, successors in script.successors().items():
            for j in successors:
                model.lm_head.weight[j, t] = LOGIT / HIDDEN_SIZE ** 0.5
    model.save_pretrained(directory, safe_serialization=True)
