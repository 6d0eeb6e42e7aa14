"""Resident memory of a serving process against its engine's weight bytes, per precision mode.

For each mode: an engine built from the same checkpoint (the real default model unless
--random-model), then in a fresh process: the imports, RSS read (anonymous and file-backed, from
/proc/self/status), an Executor on the engine with a small KV pool (--kv-tokens), one greedy request
of a few tokens, RSS read again. The growth, less the KV pool's bytes, is what serving the weights
costs; the ratio to `Engine.weight_bytes()` (the quantized weights with their scales) is 1.0 when
the weights are held once and nothing else of size is. Beside it: how much of the growth is
file-backed (pages of the mapped weights file still resident).

    python -m samples.microbench.resident_memory [--modes fp32 bf16 int8 int4 int8+a8 int4+a8] [--kv-tokens 512]
"""
from __future__ import annotations

import argparse
import os
import tempfile

from samples.microbench.decode_step import MODES
from samples.microbench.llama_cpp_compare import in_fresh_process


def rss_kib() -> dict[str, int]:
    """RssAnon and RssFile of this process, KiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile"):
                out[key] = int(value.split()[0])
    return out


def serving_growth(engine_dir: str, kv_tokens: int) -> dict[str, int]:
    """(RssAnon, RssFile) growth in bytes from before the Executor is built to after one request."""
    import torch   # noqa: F401  (imported before the first reading: its own pages are not the engine's)

    from batch_manager.executor import Executor, ExecutorConfig, KvCacheConfig, ModelType, Request
    before = rss_kib()
    config = ExecutorConfig(kv_cache_config=KvCacheConfig(max_tokens=kv_tokens))
    with Executor(engine_dir, ModelType.DECODER_ONLY, config) as executor:
        request_id = executor.enqueue_request(Request(list(range(10, 26)), 8))
        done = False
        while not done:
            for response in executor.await_responses(request_id, timeout=600.0):
                if response.has_error():
                    raise RuntimeError(response.error_msg)
                done = response.result.is_final
        after = rss_kib()
    return {key: (after[key] - before[key]) * 1024 for key in after}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--kv-tokens", type=int, default=512)
    p.add_argument("--random-model", action="store_true", help="the random-weight ~57M LLaMA-style model")
    args = p.parse_args(argv)
    from runtime import Engine, build_engine
    from samples.default_model import random_model_dir, real_model_gguf
    from samples.microbench.weight_only import cpu_description
    source = random_model_dir() if args.random_model else real_model_gguf()
    results = {}
    print(f"{cpu_description()}; resident growth of a serving process against its weight bytes "
          f"(KV pool of {args.kv_tokens} tokens subtracted):")
    with tempfile.TemporaryDirectory() as work:
        for mode in args.modes:
            engine_dir = os.path.join(work, mode)
            build_engine(source, engine_dir, **MODES[mode])
            engine = Engine.from_dir(engine_dir)
            weight_bytes = engine.weight_bytes()
            kv_bytes = engine.kv_bytes_per_token() * args.kv_tokens
            del engine
            growth = in_fresh_process(serving_growth, engine_dir, args.kv_tokens)
            resident = growth["RssAnon"] + growth["RssFile"] - kv_bytes
            results[mode] = {"weight_bytes": weight_bytes, "resident_bytes": resident, **growth}
            print(f"  {mode:8s} weights {weight_bytes / 2**20:7.1f} MiB  resident {resident / 2**20:7.1f} MiB "
                  f"({resident / weight_bytes:.2f}x; anonymous {growth['RssAnon'] / 2**20:.1f}, "
                  f"file-backed {growth['RssFile'] / 2**20:.1f} MiB)")
    return results


if __name__ == "__main__":
    main()
