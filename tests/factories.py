"""Tiny random-weight checkpoints written through transformers' real save path."""
from __future__ import annotations

import os

import torch

from runtime.step_inputs import SequenceStep, pack_step

TINY = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=96, max_position_embeddings=256)


def hf_config(arch: str, **overrides):
    import transformers
    if arch == "gpt2":
        kw = dict(vocab_size=TINY["vocab_size"], n_embd=TINY["hidden_size"], n_layer=TINY["num_hidden_layers"],
                  n_head=TINY["num_attention_heads"], n_positions=TINY["max_position_embeddings"],
                  n_inner=TINY["intermediate_size"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                  bos_token_id=1, eos_token_id=2)
        kw.update(overrides)
        return transformers.GPT2Config(**kw)
    kw = dict(TINY, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "llama":
        kw.update(num_key_value_heads=2)
        kw.update(overrides)
        return transformers.LlamaConfig(**kw)
    if arch == "mistral":
        kw.update(num_key_value_heads=2, sliding_window=8)
        kw.update(overrides)
        return transformers.MistralConfig(**kw)
    if arch == "qwen2":
        kw.update(num_key_value_heads=1, tie_word_embeddings=True)
        kw.update(overrides)
        return transformers.Qwen2Config(**kw)
    raise ValueError(arch)


def hf_model(arch: str, seed: int = 0, **overrides):
    import transformers
    config = hf_config(arch, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                          dtype=torch.float32)
    # Random init is small; widen the weights so logits are not all near-equal (clear argmax).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    return model.eval()


def make_checkpoint(directory: str | os.PathLike, arch: str = "llama", seed: int = 0,
                    max_shard_size: str | None = None, **overrides):
    """Save a tiny random `arch` model as an HF checkpoint dir; returns the transformers model."""
    model = hf_model(arch, seed, **overrides)
    kwargs = {"safe_serialization": True}
    if max_shard_size:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(os.fspath(directory), **kwargs)
    return model


def make_checkpoints(tmp_path_factory, archs=("llama", "mistral")) -> dict:
    """arch -> (checkpoint dir, transformers model), arch i written with seed i."""
    out = {}
    for seed, arch in enumerate(archs):
        path = tmp_path_factory.mktemp(arch)
        out[arch] = (path, make_checkpoint(path, arch, seed=seed))
    return out


def step_inputs(seqs: list[tuple[list[int], int, list[int]]], context_logits: bool = False) -> dict:
    """seqs: (new tokens, past length, block ids) per sequence -> ModelRunner.forward inputs."""
    return pack_step([SequenceStep(tokens, past, blocks, context_logits) for tokens, past, blocks in seqs])
