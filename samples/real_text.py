"""Real English text for the samples' real-model workloads, from what every Python install
carries: the standard library's `pydoc_data.topics` (the language reference's documentation
prose, about 450-700 KB depending on the Python version), in sorted topic order. Also the fixed
chat prompts built from it and the tokenizer of a model directory. Used by samples.quality,
samples.benchmark (the real-text workload) and the quick starts.
"""
from __future__ import annotations

import os
import re
from functools import lru_cache

# General questions with short, checkable answers (the first is the bar).
QUESTIONS = [
    "What is the capital of France?",
    "What is the largest planet in our solar system?",
    "How many days are there in a leap year?",
    "What is the boiling point of water in degrees Celsius?",
    "Who wrote the play Romeo and Juliet?",
    "What gas do plants absorb from the air?",
    "Name three primary colors.",
    "What is 12 multiplied by 11?",
    "What is the chemical symbol for gold?",
    "Translate 'good morning' into French.",
    "What is the opposite of 'ancient'?",
    "Give me a synonym for 'happy'.",
    "What does a thermometer measure?",
    "Which ocean is the largest?",
    "What is Python, in one sentence?",
    "Write a haiku about autumn.",
]


@lru_cache(maxsize=1)
def documentation_topics() -> tuple[tuple[str, str], ...]:
    """(topic, text) pairs of pydoc's topics, sorted by topic."""
    from pydoc_data.topics import topics
    return tuple(sorted(topics.items()))


def documentation_text() -> str:
    return "\n\n".join(text for _, text in documentation_topics())


def first_paragraphs(text: str, max_chars: int) -> str:
    """Whole paragraphs from the start of `text`, at most `max_chars` (at least one paragraph, cut)."""
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]
    kept: list[str] = []
    for paragraph in paragraphs:
        if kept and sum(len(p) + 2 for p in kept) + len(paragraph) > max_chars:
            break
        kept.append(paragraph)
    return "\n\n".join(kept)[:max_chars]


def passages(num: int, max_chars: int = 900) -> list[tuple[str, str]]:
    """`num` (topic, opening passage) pairs, spread evenly over the topics."""
    topics = documentation_topics()
    if num <= 0:
        return []
    step = max(1, len(topics) // num)
    return [(topic, first_paragraphs(text, max_chars)) for topic, text in topics[::step][:num]]


def chat_messages(num: int) -> list[list[dict]]:
    """`num` chat conversations: the general questions, then questions about documentation passages."""
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS[:num]]
    for topic, passage in passages(max(0, num - len(conversations)), max_chars=600):
        conversations.append([{"role": "user", "content":
                               f"Here is part of Python's documentation:\n\n{passage}\n\n"
                               "In one sentence, what is this passage about?"}])
    return conversations[:num]


def quote_messages(num: int) -> list[list[dict]]:
    """`num` copying-heavy conversations (the answer quotes the prompt): prompt lookup's workload."""
    return [[{"role": "user", "content": f"Repeat the following text word for word:\n\n{passage}"}]
            for _, passage in passages(num, max_chars=700)]


def load_tokenizer(model_dir: str):
    """The Hugging Face tokenizer of an engine directory built from a GGUF (or any HF tokenizer directory)."""
    import transformers
    directory = os.path.dirname(model_dir) if model_dir.endswith(".gguf") else model_dir
    if not os.path.exists(os.path.join(directory, "tokenizer.json")):
        raise ValueError(f"{model_dir!r} has no tokenizer.json: the real-text workloads need the model's tokenizer "
                         "(an engine directory built from a GGUF file holds one)")
    return transformers.AutoTokenizer.from_pretrained(directory)


def chat_prompt_ids(tokenizer, conversations: list[list[dict]]) -> list[list[int]]:
    """Token ids of each conversation with the chat template and the assistant's turn opened."""
    return [list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                               return_dict=False))
            for messages in conversations]


def end_ids(tokenizer) -> list[int]:
    """Ids that end a chat answer: the tokenizer's end of sequence and, where it has one, <|im_end|>."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    return sorted(ids)


def text_windows(tokenizer, num_windows: int, window_len: int) -> list[list[int]]:
    """Consecutive, non-overlapping windows of the documentation text's tokens, from its start."""
    ids = tokenizer(documentation_text(), add_special_tokens=False, verbose=False)["input_ids"]
    if len(ids) < num_windows * window_len:
        raise ValueError(f"--windows/--window-len: the text has {len(ids)} tokens, fewer than "
                         f"{num_windows} x {window_len}")
    return [ids[i * window_len:(i + 1) * window_len] for i in range(num_windows)]
