"""Tiny PEFT LoRA adapters written through peft's real save path, and transformers references for
LoRA and prompt-tuned requests (teacher-forced: the logits of every generated position)."""
from __future__ import annotations

import copy
import os

import torch

# Every projection of each family (GPT-2's fused Conv1D modules; the LLaMA family's seven).
ALL_TARGETS = {"gpt2": ["c_attn", "c_proj", "c_fc"],
               "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
# A second adapter on a subset of the modules.
SOME_TARGETS = {"gpt2": ["c_attn", "c_fc"], "llama": ["q_proj", "v_proj", "up_proj", "down_proj"]}


def family(arch: str) -> str:
    return "gpt2" if arch == "gpt2" else "llama"


def make_peft_adapter(model, directory: str | os.PathLike, r: int, alpha: float, targets: list[str],
                      seed: int, use_rslora: bool = False):
    """Wrap a copy of `model` in a LoRA adapter with random (non-zero) A and B, save it as a PEFT
    directory (safetensors) and return the PEFT model (eval mode)."""
    from peft import LoraConfig, get_peft_model
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, use_rslora=use_rslora,
                        fan_in_fan_out=model.config.model_type == "gpt2")
    peft_model = get_peft_model(copy.deepcopy(model), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    peft_model.save_pretrained(os.fspath(directory))
    return peft_model.eval()


@torch.no_grad()
def teacher_forced_logits(model, prompt_embeds: torch.Tensor, generated: list[int]) -> torch.Tensor:
    """float32 [len(generated), V]: the logits that predicted each generated token, from the prompt's
    input embeddings [L, H] followed by the generated tokens' embeddings."""
    embed = model.get_input_embeddings()
    tokens = torch.tensor(generated[:-1], dtype=torch.long)
    embeds = torch.cat([prompt_embeds, embed(tokens)]) if len(generated) > 1 else prompt_embeds
    logits = model(inputs_embeds=embeds[None]).logits[0]
    return logits[prompt_embeds.shape[0] - 1:].float()


def prompt_embeds(model, prompt: list[int], table: torch.Tensor | None = None) -> torch.Tensor:
    """[L, H]: the prompt's input embeddings, ids >= vocab_size taking rows of `table`."""
    vocab = model.config.vocab_size
    ids = torch.tensor([t if t < vocab else 0 for t in prompt], dtype=torch.long)
    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids).clone()
        for i, t in enumerate(prompt):
            if t >= vocab:
                embeds[i] = table[t - vocab]
    return embeds
