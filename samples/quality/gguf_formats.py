"""GGUF block formats side by side (samples.quality --gguf-formats): the real model's weights, as a
float32 GGUF, written again in each format (llama_cpp_compare.rewrite_gguf: a GGML type for every
2-D weight, or the Q4_K_M recipe); per format, our engine built from that file with its blocks kept
(build_engine(..., weight_format="keep")): its perplexity on the text windows against the float32
file's, and its greedy answers to the chat prompts against llama.cpp's on the same file (the
`xllamacpp` wheel; skipped with a note where it is not installed): the tokens each pair agrees on
before the first difference, out of the first `max_tokens` of every answer. Both sides ignore the end
id and generate exactly `max_tokens`, so that answers are compared over equal lengths.
"""
from __future__ import annotations

import math
import os

from runtime import ConfigError, build_engine


def llama_cpp_greedy(path: str, prompts: list[list[int]], max_tokens: int, threads: int) -> list[list[int]]:
    """llama.cpp's greedy tokens per prompt (one slot; the end id ignored)."""
    from samples.microbench.llama_cpp_compare import llama_cpp_server
    server = llama_cpp_server(path, threads, 1, max(map(len, prompts)) + max_tokens + 16)
    answers = []
    for prompt in prompts:
        body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1, "ignore_eos": True,
                "cache_prompt": False, "n_probs": 1}
        result = server.handle_completions(body)
        try:   # the OpenAI-style answer: each generated token's id under its log prob
            answers.append([int(t["id"]) for t in result["choices"][0]["logprobs"]["content"]])
        except (KeyError, IndexError, TypeError):
            raise RuntimeError(f"llama.cpp: {result!r:.500}") from None
    return answers


def leading_agreement(ours: list[int], theirs: list[int], max_tokens: int) -> int:
    """How many of the first max_tokens tokens agree before the first difference."""
    count = 0
    for a, b in zip(ours[:max_tokens], theirs[:max_tokens]):
        if a != b:
            break
        count += 1
    return count


def compare_formats(formats: list[str], windows: list[list[int]], prompts: list[list[int]], max_tokens: int,
                    work_dir: str, threads: int) -> dict:
    """Per format: perplexity (ours, blocks kept), its ratio to the float32 file's, the weight bytes,
    and the greedy agreement with llama.cpp on the same file."""
    from samples.microbench.llama_cpp_compare import in_fresh_process, model_files
    from samples.quality.agreement import serve
    from samples.quality.perplexity import runtime_nll
    try:
        import xllamacpp  # noqa: F401
        have_llama_cpp = True
    except ImportError:
        have_llama_cpp = False
    files, _ = model_files("smollm2", work_dir, ["F32", *formats])
    results: dict = {}
    baseline = None
    for type_name in ["F32", *[f for f in formats if f != "F32"]]:
        engine_dir = os.path.join(work_dir, f"quality-{type_name}")
        fields = {} if type_name == "F32" else {"weight_format": "keep"}
        try:
            engine = build_engine(files[type_name], engine_dir, **fields)
        except ConfigError as e:
            results[type_name] = {"refused": str(e)}
            continue
        nll = runtime_nll(engine_dir, windows)
        row: dict = {"weight_bytes": engine.weight_bytes(), "perplexity": math.exp(sum(nll) / len(nll))}
        baseline = baseline or row
        row["perplexity_vs_f32"] = row["perplexity"] / baseline["perplexity"] - 1.0
        if have_llama_cpp:
            ours = [tokens for tokens, _ in serve(engine_dir, prompts, max_tokens, end_id=None)]
            theirs = in_fresh_process(llama_cpp_greedy, files[type_name], prompts, max_tokens, threads)
            agreed = [leading_agreement(a, b, max_tokens) for a, b in zip(ours, theirs)]
            row["tokens_agreeing_with_llama_cpp"] = sum(agreed)
            row["answers_equal_to_llama_cpp"] = sum(a == max_tokens for a in agreed)
        results[type_name] = row
    return results


def print_formats(results: dict, num_prompts: int, max_tokens: int) -> None:
    print(f"GGUF formats, blocks kept (perplexity on the same windows against the float32 file; greedy agreement "
          f"with llama.cpp on the same file over the first {max_tokens} tokens of {num_prompts} chat prompts):")
    for type_name, row in results.items():
        if "refused" in row:
            print(f"  {type_name:7s} refused: {row['refused']}")
            continue
        line = (f"  {type_name:7s} weights {row['weight_bytes'] / 2**20:6.1f} MiB, perplexity {row['perplexity']:.4f} "
                f"({row['perplexity_vs_f32']:+.2%})")
        if "tokens_agreeing_with_llama_cpp" in row:
            total = num_prompts * max_tokens
            line += (f", tokens agreeing with llama.cpp {row['tokens_agreeing_with_llama_cpp']}/{total} "
                     f"({row['tokens_agreeing_with_llama_cpp'] / total:.0%}), whole answers equal "
                     f"{row['answers_equal_to_llama_cpp']}/{num_prompts}")
        else:
            line += " (llama.cpp: xllamacpp is not installed)"
        print(line)
