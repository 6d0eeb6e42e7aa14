"""The default model of the samples: a ~50M-parameter LLaMA-style checkpoint with random weights.

Written as a real Hugging Face checkpoint directory (config.json + model.safetensors, HF tensor
names) without needing transformers or a download, into a cache directory, once. Its outputs
are meaningless tokens: it exists to exercise and measure the serving path. Any HF checkpoint or
engine directory can replace it.
"""
from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import torch
from safetensors.torch import save_file

DEFAULT_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "batch_manager")

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


def default_model_dir(cache_dir: str | None = None) -> str:
    """The default model's checkpoint directory, written on first use."""
    directory = os.path.join(cache_dir or os.environ.get("BATCH_MANAGER_CACHE", DEFAULT_CACHE_DIR), "llama-50m-random")
    if not os.path.exists(os.path.join(directory, "config.json")):
        # Written aside and renamed, so a concurrent or interrupted first run never leaves half a model.
        tmp = directory + f".tmp{os.getpid()}"
        # NOTE: on a helper thread that then exits, taking its OpenMP thread pool with it: a
        # pool left on this thread would slow the GptManager worker's CPU steps (see GptManager).
        with ThreadPoolExecutor(1) as writer:  # its thread is joined on leaving the block
            writer.submit(write_random_llama, tmp).result()
        try:
            os.replace(tmp, directory)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    return directory

