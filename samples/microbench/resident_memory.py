"""Resident memory of a serving process against its engine's weight bytes, per precision mode.

For each mode: an engine built from the same checkpoint (the real default model unless
--random-model), then in a fresh process: the imports and the native library loaded, memory read
(/proc/self/smaps), an Executor on the engine with a small KV pool (--kv-tokens), one greedy
request of a few tokens, memory read again. The resident weights are the anonymous growth less the
KV pool's bytes plus the resident pages of the engine's weights file (a mapped tensor is read in
place); the ratio to `Engine.weight_bytes()` (the weights as stored, quantized ones with their
scales) is 1.0 when the weights are held once and nothing else of size is. Other file-backed growth
(code pages of the libraries a first request touches) is shown apart.

    python -m samples.microbench.resident_memory [--modes fp32 bf16 int8 int4 int8+a8 int4+a8 blocks] [--kv-tokens 512]
"""
from __future__ import annotations

import argparse
import os
import tempfile

from samples.microbench.decode_step import MODES, modes_for
from samples.microbench.llama_cpp_compare import in_fresh_process


def memory_kib(path: str) -> dict[str, int]:
    """This process's resident KiB: "anonymous", "file" (other files' pages) and "path" (the mappings of
    the file `path`), summed over /proc/self/smaps. "path" sums Pss, not Rss: each stored tensor is
    its own mapping (runtime.loading.tensor_files), and the page two neighbours share is one page
    of memory mapped twice, which Rss would count twice."""
    out = {"anonymous": 0, "file": 0, "path": 0}
    mapped = ""
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):   # a mapping's header line
                mapped = fields[5] if len(fields) > 5 else ""
            elif fields[0] == "Anonymous:":
                out["anonymous"] += int(fields[1])
            elif fields[0] == "Rss:" and mapped.startswith("/") and mapped != path:
                out["file"] += int(fields[1])
            elif fields[0] == "Pss:" and mapped == path:
                out["path"] += int(fields[1])
    return out


def warm_process() -> None:
    """What every mode's process loads before the first reading: torch's thread pool, the native library."""
    import torch
    from runtime.kernels.cpu.act_quant import act_quant_ops
    from runtime.kernels.cpu.cpu_native import native_ops
    native_ops(), act_quant_ops()
    torch.ones(64, 64) @ torch.ones(64, 64)


def growth_bytes(before: dict[str, int], after: dict[str, int], kv_bytes: int) -> dict[str, int]:
    """The resident weights (anonymous growth less the KV pool, plus the weights file's pages) and
    the other file-backed growth, bytes."""
    anonymous = (after["anonymous"] - before["anonymous"]) * 1024 - kv_bytes
    return {"resident": anonymous + (after["path"] - before["path"]) * 1024, "anonymous": anonymous,
            "weights_file": (after["path"] - before["path"]) * 1024,
            "other_file": (after["file"] - before["file"]) * 1024}


def serving_growth(engine_dir: str, kv_tokens: int, kv_bytes: int) -> dict[str, int]:
    """growth_bytes from before the Executor is built to after one request."""
    warm_process()
    from batch_manager.executor import Executor, ExecutorConfig, KvCacheConfig, ModelType, Request
    from runtime.engine import ENGINE_WEIGHTS_FILE
    path = os.path.realpath(os.path.join(engine_dir, ENGINE_WEIGHTS_FILE))
    before = memory_kib(path)
    config = ExecutorConfig(kv_cache_config=KvCacheConfig(max_tokens=kv_tokens))
    with Executor(engine_dir, ModelType.DECODER_ONLY, config) as executor:
        request_id = executor.enqueue_request(Request(list(range(10, 26)), 8))
        done = False
        while not done:
            for response in executor.await_responses(request_id, timeout=600.0):
                if response.has_error():
                    raise RuntimeError(response.error_msg)
                done = response.result.is_final
        after = memory_kib(path)
    return growth_bytes(before, after, kv_bytes)


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
    print(f"{cpu_description()}; resident weights of a serving process (anonymous growth less the KV pool of "
          f"{args.kv_tokens} tokens, plus the weights file's pages) against the weight bytes:")
    with tempfile.TemporaryDirectory() as work:
        for mode in modes_for(source, args.modes):
            engine_dir = os.path.join(work, mode)
            build_engine(source, engine_dir, **MODES[mode])
            engine = Engine.from_dir(engine_dir)
            weight_bytes = engine.weight_bytes()
            kv_bytes = engine.kv_bytes_per_token() * args.kv_tokens
            del engine
            growth = in_fresh_process(serving_growth, engine_dir, args.kv_tokens, kv_bytes)
            results[mode] = {"weight_bytes": weight_bytes, **growth}
            print(f"  {mode:8s} weights {weight_bytes / 2**20:7.1f} MiB  resident {growth['resident'] / 2**20:7.1f} "
                  f"MiB ({growth['resident'] / weight_bytes:.3f}x; anonymous {growth['anonymous'] / 2**20:.1f}, "
                  f"weights file {growth['weights_file'] / 2**20:.1f} MiB; other file-backed "
                  f"{growth['other_file'] / 2**20:.1f} MiB)")
    return results


if __name__ == "__main__":
    main()
