"""`python -m runtime.build`: convert a Hugging Face checkpoint or a GGUF file into an engine directory
(from a GGUF file, with its tokenizer files beside the weights)."""
from __future__ import annotations

import argparse
import sys

from .config import BuildConfig, ConfigError
from .engine import build_engine
from .precision import (ACT_QUANT_MODES, BUILD_DTYPES, GROUP_SIZES, KV_CACHE_DTYPES, WEIGHT_FORMATS,
                        WEIGHT_ONLY_SKIPPABLE, QuantMode)
from .loading.weights import WeightError
from .quantization import supported_formats


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = BuildConfig()
    p = argparse.ArgumentParser(prog="python -m runtime.build", description=__doc__)
    p.add_argument("--checkpoint", required=True,
                   help="HF checkpoint directory (config.json + *.safetensors), or a .gguf file")
    p.add_argument("--output", required=True, help="engine directory to write")
    p.add_argument("--dtype", default=defaults.dtype, choices=list(BUILD_DTYPES),
                   help="auto: bfloat16 where the loading machine has AMX-BF16 / AVX512-BF16 or CUDA, else float32")
    p.add_argument("--weight-only", choices=list(supported_formats()), default=None,
                   help="int8 (a scale per output channel) or int4 (a scale per group of input columns) weights")
    p.add_argument("--weight-format", choices=list(WEIGHT_FORMATS), default=None,
                   help="a GGUF file's quantized blocks: keep (the matmuls run in the file's formats, one per "
                        "tensor), dequantize (every tensor in --dtype), auto (keep where the native block "
                        "kernels run on this machine; the default, or an engine directory's recorded choice)")
    p.add_argument("--group-size", type=int, default=defaults.group_size, choices=list(GROUP_SIZES))
    p.add_argument("--weight-only-skip", action="append", choices=list(WEIGHT_ONLY_SKIPPABLE), default=[],
                   help="keep this layer in --dtype (repeatable)")
    p.add_argument("--act-quant", choices=list(ACT_QUANT_MODES), default=None,
                   help="with --weight-only: the matmuls' activations quantized to int8 per block of 32 columns "
                        "(integer dot products: faster on CPUs with VNNI, not exact)")
    p.add_argument("--kv-cache-dtype", default=defaults.kv_cache_dtype, choices=list(KV_CACHE_DTYPES))
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
                  gather_generation_logits=args.gather_generation_logits or args.gather_all_token_logits,
                  weight_only=args.weight_only, group_size=args.group_size,
                  weight_only_skip=tuple(args.weight_only_skip), kv_cache_dtype=args.kv_cache_dtype,
                  act_quant=args.act_quant)
    if args.weight_format is not None:
        fields["weight_format"] = args.weight_format
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
    print(f"runs here in {cfg.dtype}, quant mode {QuantMode(cfg.quant_mode)!r}: weights {engine.weight_bytes() / 2**20:.1f} "
          f"MiB, KV cache {engine.kv_bytes_per_token()} bytes per token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
