"""What an int8 KV cache costs and buys on the real default model (SmolLM2-135M) unless --model:

1. KV bytes per token, float32 vs int8 (values + scales), and the blocks a 1 GiB pool holds.
2. The scale layout: the K/V of a real text (read back from a float32 cache) quantized per
   (token, head) and per (block, head); relative RMS error and bytes per token of each.
3. Quality: next-token NLL (perplexity) over real text windows, every token after the first
   quarter attended through the cache by generation steps, float32 vs int8 cache.
4. Speed: one generation step of a batch of --batch sequences with --past cached tokens each.

    python -m samples.microbench.kv_cache_dtype [--model DIR] [--batch 64] [--past 256] [--steps 8]
"""
from __future__ import annotations

import argparse
import math
import time

import torch

from runtime import Engine, ModelRunner
from runtime.kernels.kv_quant import dequantize, quantize_rows
from samples.default_model import add_model_arguments, model_from_arguments
from samples.real_text import load_tokenizer, text_windows
from runtime.step_inputs import SequenceStep, pack_step

DTYPES = ("auto", "int8")


def step_inputs(seqs: list[tuple[list[int], int, list[int]]], context_logits: bool = False) -> dict:
    """(new tokens, past length, block ids) per sequence -> ModelRunner.forward inputs."""
    return pack_step([SequenceStep(tokens, past, blocks, context_logits) for tokens, past, blocks in seqs])


def bytes_report(model_dir: str) -> None:
    for kv in DTYPES:
        engine = Engine.from_dir(model_dir, kv_cache_dtype=kv)
        per_block = ModelRunner.kv_bytes_per_block(engine)
        print(f"kv_cache_dtype={kv:5s} {engine.kv_bytes_per_token():7d} KV bytes per token; a 1 GiB pool holds "
              f"{(1 << 30) // per_block} blocks of {engine.build_config.tokens_per_block} tokens")


def fp32_cache_of(model_dir: str, tokens: list[int]) -> tuple[torch.Tensor, int]:
    """The float32 K/V of `tokens` [layers, 2, num_tokens, kvH, D], read back from the pool."""
    engine = Engine.from_dir(model_dir)
    tpb = engine.build_config.tokens_per_block
    num_blocks = -(-len(tokens) // tpb)
    runner = ModelRunner(engine, num_blocks)
    runner.forward(step_inputs([(tokens, 0, list(range(num_blocks)))]))
    pool = runner.kv_pool            # [L, 2, nb, tpb, kvH, D]
    return pool.flatten(2, 3)[:, :, :len(tokens)], tpb


def scale_layout_report(model_dir: str, tokens: list[int]) -> None:
    kv, tpb = fp32_cache_of(model_dir, tokens)
    num_layers, _, num_tokens, kv_heads, head_dim = kv.shape
    token_head = dequantize(*quantize_rows(kv, torch.int8))
    # Per (block, head): one scale for a block's rows of a head (its final maximum: the best case; a
    # growing scale re-quantizes earlier rows on top).
    blocks = kv[:, :, :num_tokens // tpb * tpb].unflatten(2, (-1, tpb))          # [L, 2, nb, tpb, kvH, D]
    scales = blocks.abs().amax(dim=(3, 5), keepdim=True) / 127
    block_head = (blocks / scales.clamp(min=1e-30)).round().clamp(-127, 127) * scales
    exact = blocks.flatten(2, 3)
    for name, approx in (("token_head", token_head[:, :, :exact.shape[2]]), ("block_head", block_head.flatten(2, 3))):
        errors = [float((approx[:, i] - exact[:, i]).pow(2).mean().sqrt() / exact[:, i].pow(2).mean().sqrt())
                  for i in (0, 1)]
        scale_bytes = 4 if name == "token_head" else 4 / tpb
        row_bytes = head_dim + scale_bytes
        print(f"scales {name:10s}: relative RMS error K {errors[0]:.4f} V {errors[1]:.4f}; "
              f"{num_layers * 2 * kv_heads * row_bytes:.0f} bytes per token "
              f"(float32 {num_layers * 2 * kv_heads * head_dim * 4})")


def nll(model_dir: str, kv: str, window: list[int]) -> float:
    """Mean next-token NLL of window[1:]: the first quarter as one context step, then one
    generation step per token (each reads every earlier key through the cache)."""
    engine = Engine.from_dir(model_dir, kv_cache_dtype=kv)
    tpb = engine.build_config.tokens_per_block
    blocks = list(range(-(-len(window) // tpb)))
    runner = ModelRunner(engine, len(blocks))
    first = len(window) // 4
    logits = [runner.forward(step_inputs([(window[:first], 0, blocks)], True))["context_logits"]]
    for pos in range(first, len(window) - 1):
        logits.append(runner.forward(step_inputs([([window[pos]], pos, blocks)]))["logits"])
    log_probs = torch.log_softmax(torch.cat(logits), -1)
    targets = torch.tensor(window[1:])
    return float(-log_probs[torch.arange(len(targets)), targets].mean())


def filled_runner(model_dir: str, kv: str, batch: int, past: int, extra: int, prompt: list[int]):
    """A runner whose `batch` sequences hold `past` cached tokens (copies of one real prefix)."""
    engine = Engine.from_dir(model_dir, kv_cache_dtype=kv)
    tpb = engine.build_config.tokens_per_block
    per_seq = -(-(past + extra) // tpb)
    runner = ModelRunner(engine, batch * per_seq)
    tables = [list(range(s * per_seq, (s + 1) * per_seq)) for s in range(batch)]
    runner.forward(step_inputs([(prompt[:past], 0, tables[0])]))
    src = tables[0][:-(-past // tpb)]
    for table in tables[1:]:
        runner.copy_blocks(src, table[:len(src)])
    return runner, tables


def step_times_ms(model_dir: str, batch: int, past: int, num_steps: int, prompt: list[int]) -> dict:
    """kv -> (median generation step ms, median decode attention ms of one layer), the caches'
    steps interleaved (A/B/A/B) so that load from elsewhere on the machine hits both alike."""
    runners = {kv: filled_runner(model_dir, kv, batch, past, num_steps + 2, prompt) for kv in DTYPES}
    steps, attention = {kv: [] for kv in DTYPES}, {kv: [] for kv in DTYPES}
    for step in range(num_steps + 2):          # two warm-up steps
        for kv, (runner, tables) in runners.items():
            seqs = [([prompt[(past + step + s) % len(prompt)]], past + step, t) for s, t in enumerate(tables)]
            start = time.perf_counter()
            runner.forward(step_inputs(seqs))
            steps[kv].append(time.perf_counter() - start)
            attention[kv].append(_layer_attention_s(runner, tables, past + step + 1))
    median = lambda xs: 1000 * sorted(xs[2:])[len(xs[2:]) // 2]
    return {kv: (median(steps[kv]), median(attention[kv])) for kv in DTYPES}


def _layer_attention_s(runner: ModelRunner, tables: list[list[int]], seq_len: int) -> float:
    cfg = runner.model.local
    q = torch.randn(len(tables), cfg.num_heads, cfg.head_dim)
    block_tables = torch.tensor(tables, dtype=torch.int32)
    lens = torch.full((len(tables),), seq_len)
    quant = {} if runner.kv_scales is None else {"k_scales": runner.kv_scales[0, 0], "v_scales": runner.kv_scales[0, 1]}
    start = time.perf_counter()
    with torch.inference_mode():
        runner.kernels.decode_attention(q, runner.kv_pool[0, 0], runner.kv_pool[0, 1], block_tables, lens,
                                        0.125, None, 0, None, **quant)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--past", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--windows", type=int, default=2, help="real text windows for the perplexity")
    parser.add_argument("--window-len", type=int, default=160)
    parser.add_argument("--parts", default="1,2,3,4")
    args = parser.parse_args()
    model_dir = model_from_arguments(args.model, args.random_model)
    parts = set(args.parts.split(","))
    texts = text_windows(load_tokenizer(model_dir), max(args.windows, 1) + 2, max(args.window_len, args.past + 16))
    print(f"model {model_dir}, {torch.get_num_threads()} threads")
    if "1" in parts:
        bytes_report(model_dir)
    if "2" in parts:
        scale_layout_report(model_dir, texts[0])
    if "3" in parts:
        for kv in DTYPES:
            values = [nll(model_dir, kv, w[:args.window_len]) for w in texts[1:1 + args.windows]]
            mean = sum(values) / len(values)
            print(f"kv_cache_dtype={kv:5s} NLL {mean:.4f} (perplexity {math.exp(mean):.3f}) over "
                  f"{args.windows} windows of {args.window_len} tokens")
    if "4" in parts:
        for kv, (step_ms, attention_ms) in step_times_ms(model_dir, args.batch, args.past, args.steps,
                                                         texts[-1]).items():
            print(f"kv_cache_dtype={kv:5s} batch {args.batch}, past {args.past}: generation step {step_ms:.1f} ms, "
                  f"decode attention of one layer {attention_ms:.2f} ms (medians)")


if __name__ == "__main__":
    main()
