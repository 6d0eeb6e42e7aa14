"""The benchmark's real-text workload: chat-templated prompts (general questions and questions on
passages of Python's documentation, samples.real_text) through our GptManager loop, greedy, each
ending at the model's end of turn or at --real-text-max-tokens; prints the figures and a few answers.
Needs the model's tokenizer (the default model's engine directory holds it)."""
from __future__ import annotations

from samples.benchmark.dataset import Sample
from samples.benchmark.report import format_text, metrics
from samples.real_text import chat_messages, chat_prompt_ids, end_ids, load_tokenizer

NUM_ANSWERS_SHOWN = 3


def run_real_text(args, model_dir: str) -> dict:
    from samples.benchmark.ours import run_ours
    tokenizer = load_tokenizer(model_dir)
    conversations = chat_messages(args.real_text_prompts)
    prompts = chat_prompt_ids(tokenizer, conversations)
    samples = [Sample(ids, args.real_text_max_tokens) for ids in prompts]
    result = run_ours(model_dir, samples, [0.0] * len(samples), args, end_id=end_ids(tokenizer)[0])
    figures = metrics(result)
    print(format_text(f"ours (GptManager, real text: {len(samples)} chat prompts, {sum(map(len, prompts))} prompt "
                      f"tokens, greedy, up to {args.real_text_max_tokens} new tokens each)", figures))
    figures["answers"] = []
    for messages, tokens in list(zip(conversations, result.outputs))[:NUM_ANSWERS_SHOWN]:
        answer = tokenizer.decode(tokens, skip_special_tokens=True).strip()
        figures["answers"].append({"prompt": messages[0]["content"], "answer": answer})
        question = messages[0]["content"].splitlines()[0]
        print(f"  Q: {question}\n  A: {answer}")
    return figures
