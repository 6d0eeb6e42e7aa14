"""A tokenizer for the samples' default model (`--tokenizer default`): a byte-level BPE with the
model's 32000 ids, trained once on this Python's standard-library sources (present wherever the
samples run, so no download) and saved as a Hugging Face tokenizer directory with a ChatML chat
template in tokenizer_config.json, next to the default model. The model's weights are random,
so its text is as meaningless as its tokens: the tokenizer exists to exercise the text paths
(detokenization, stop strings, chat templates) and measure them."""
from __future__ import annotations

import glob
import json
import os
import shutil
import sysconfig

from samples.default_model import DEFAULT_CACHE_DIR, LLAMA_50M

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]   # ids 0..4: bos 1, eos 2 as the model's
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MAX_TRAINING_BYTES = 12 << 20


def _training_files(max_bytes: int) -> list[str]:
    """The standard library's sources in a fixed order, tests left out, up to max_bytes."""
    root = sysconfig.get_paths()["stdlib"]
    files, total = [], 0
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        if f"{os.sep}test" in path[len(root):] or "site-packages" in path:
            continue
        files.append(path)
        total += os.path.getsize(path)
        if total >= max_bytes:
            break
    return files


def write_default_tokenizer(directory: str, vocab_size: int = LLAMA_50M["vocab_size"]) -> str:
    """Train and save the tokenizer; exactly vocab_size ids (reserved special tokens fill any ids
    the merges did not reach). Returns the directory."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers
    import transformers

    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train(_training_files(MAX_TRAINING_BYTES), trainer)
    missing = vocab_size - tokenizer.get_vocab_size()
    tokenizer.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    assert tokenizer.get_vocab_size() == vocab_size, tokenizer.get_vocab_size()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                                                eos_token="</s>", pad_token="<unk>")
    fast.save_pretrained(directory)
    config_path = os.path.join(directory, "tokenizer_config.json")   # the template where tools look first
    with open(config_path) as f:
        config = json.load(f)
    config["chat_template"] = CHAT_TEMPLATE
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
    return directory


def default_tokenizer_dir(cache_dir: str | None = None) -> str:
    """The default model's tokenizer directory, written on first use (aside, then renamed)."""
    root = cache_dir or os.environ.get("BATCH_MANAGER_CACHE", DEFAULT_CACHE_DIR)
    directory = os.path.join(root, "llama-50m-random-tokenizer")
    if not os.path.exists(os.path.join(directory, "tokenizer_config.json")):
        tmp = directory + f".tmp{os.getpid()}"
        write_default_tokenizer(tmp)
        try:
            os.replace(tmp, directory)
        except OSError:   # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    return directory
