"""`python -m runtime.build`: convert a Hugging Face checkpoint or a GGUF file into an engine directory
(from a GGUF file, with its tokenizer files beside the weights)."""
from __future__ import annotations

import argparse
import sys

from .config import BuildConfig, ConfigError
from .engine import build_engine
from .weights import WeightError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = BuildConfig()
    p = argparse.ArgumentParser(prog="python -m runtime.build", description=__doc__)
    p.add_argument("--checkpoint", required=True,
                   help="HF checkpoint directory (config.json + *.safetensors), or a .gguf file")
    p.add_argument("--output", required=True, help="engine directory to write")
    p.add_argument("--dtype", default=defaults.dtype, choices=["float32", "float16", "bfloat16"])
    p.add_argument("--max-batch-size", type=int, default=defaults.max_batch_size)
    p.add_argument("--max-input-len", type=int, default=None,
                   help="default: min(max_position_embeddings, 2048) - 1")
    p.add_argument("--max-seq-len", type=int, default=None, help="default: min(max_position_embeddings, 2048)")
    p.add_argument("--max-num-tokens", type=int, default=defaults.max_num_tokens)
    p.add_argument("--max-beam-width", type=int, default=defaults.max_beam_width)
    p.add_argument("--tokens-per-block", type=int, default=defaults.tokens_per_block)
    p.add_argument("--gather-context-logits", action="store_true")
    p.add_argument("--gather-generation-logits", action="store_true")
    p.add_argument("--gather-all-token-logits", action="store_true", help="both of the above")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    fields = dict(dtype=args.dtype, max_batch_size=args.max_batch_size, max_num_tokens=args.max_num_tokens,
                  max_beam_width=args.max_beam_width, tokens_per_block=args.tokens_per_block,
                  gather_context_logits=args.gather_context_logits or args.gather_all_token_logits,
                  gather_generation_logits=args.gather_generation_logits or args.gather_all_token_logits)
    if args.max_seq_len is not None:
        fields["max_seq_len"] = args.max_seq_len
    if args.max_input_len is not None:
        fields["max_input_len"] = args.max_input_len
    try:
        engine = build_engine(args.checkpoint, args.output, **fields)
    except (ConfigError, WeightError, ImportError) as e:   # ImportError: a GGUF tokenizer needs transformers
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg = engine.model_config
    print(f"wrote {args.output}: {cfg.architecture}, {cfg.num_params() / 1e6:.1f}M parameters, "
          f"{engine.build_config}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
