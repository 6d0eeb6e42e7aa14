"""Quick start: generate with GptSession on the default model (built on first run).

    python -m samples.quickstart [--model DIR] [--batch 8] [--max-new-tokens 32]
"""
from __future__ import annotations

import argparse
import time

import torch

from runtime import Engine, GenerationInput, GenerationOutput, GptSession, SamplingConfig, WorldConfig
from samples.default_model import default_model_dir


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF checkpoint or engine directory (default: the random 50M LLaMA-style model)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=32)
    args = p.parse_args()

    model_dir = args.model or default_model_dir()
    engine = Engine.from_dir(model_dir)
    cfg = engine.model_config
    print(f"model: {model_dir} ({cfg.architecture}, {cfg.num_params() / 1e6:.1f}M parameters, {engine.build_config.dtype})")
    session = GptSession(GptSession.Config(args.batch, 1, args.prompt_len + args.max_new_tokens),
                         cfg, WorldConfig(), engine)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.prompt_len // 2, args.prompt_len + 1, (args.batch,), generator=gen)
    ids = torch.zeros(args.batch, args.prompt_len, dtype=torch.int32)
    for i, n in enumerate(lengths.tolist()):
        ids[i, :n] = torch.randint(3, cfg.vocab_size, (n,), generator=gen)
    inputs = GenerationInput(end_id=-1, pad_id=0, ids=ids, lengths=lengths.int())
    inputs.max_new_tokens = args.max_new_tokens
    output = GenerationOutput()
    start = time.perf_counter()
    session.generate(output, inputs, SamplingConfig(beam_width=1))
    elapsed = time.perf_counter() - start
    generated = int((output.lengths.flatten() - lengths).sum())
    print(f"batch {args.batch}: {generated} tokens in {elapsed:.2f} s ({generated / elapsed:.0f} tokens/s)")
    print("first sequence:", output.ids[0, 0, :int(output.lengths[0, 0])].tolist())


if __name__ == "__main__":
    main()
