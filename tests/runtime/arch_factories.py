"""Tiny random-weight checkpoints of the architectures beyond GPT-2 and LLaMA / Mistral / Qwen2, saved
through transformers' real save path. A case names a config class and its variant options; the
sizes are tests.factories.TINY's (hidden 64, 4 heads of 16 dims, 2 layers, vocab 128) under each
class's own keys."""
from __future__ import annotations

import os

import torch

from tests.factories import TINY

# config class -> the TINY sizes (and no dropout) in its own keys
SIZES = {
    "GPTJConfig": dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_inner=96, n_positions=256, resid_pdrop=0.0,
                       embd_pdrop=0.0, attn_pdrop=0.0),
    "GPTNeoXConfig": dict(TINY),
    "BloomConfig": dict(vocab_size=128, hidden_size=64, n_layer=2, n_head=4),
    "FalconConfig": dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         ffn_hidden_size=96, max_position_embeddings=256),
    "PhiConfig": dict(TINY, resid_pdrop=0.0, embd_pdrop=0.0),
    "Phi3Config": dict(TINY),
    "Qwen3Config": dict(TINY, head_dim=16),
}
# case -> (transformers config class, the case's options on top of SIZES)
CASES = {
    "gptj": ("GPTJConfig", dict(rotary_dim=8)),
    "gpt_neox": ("GPTNeoXConfig", dict(rotary_pct=0.25, rotary_emb_base=10000)),
    "gpt_neox_sequential": ("GPTNeoXConfig", dict(rotary_pct=0.5, use_parallel_residual=False,
                                                  tie_word_embeddings=True)),
    "bloom": ("BloomConfig", dict()),
    "bloom_6_heads": ("BloomConfig", dict(hidden_size=96, n_head=6, tie_word_embeddings=False)),
    "falcon_7b": ("FalconConfig", dict(multi_query=True, parallel_attn=True, new_decoder_architecture=False)),
    "falcon_new_decoder": ("FalconConfig", dict(new_decoder_architecture=True, num_kv_heads=2, bias=True,
                                                tie_word_embeddings=False)),
    "falcon_new_decoder_one_norm": ("FalconConfig", dict(new_decoder_architecture=True, num_kv_heads=1,
                                                         num_ln_in_parallel_attn=1)),
    "falcon_sequential": ("FalconConfig", dict(multi_query=False, parallel_attn=False, bias=True)),
    "phi": ("PhiConfig", dict(partial_rotary_factor=0.5)),
    "phi3": ("Phi3Config", dict(num_key_value_heads=2, partial_rotary_factor=0.5, sliding_window=8, pad_token_id=0)),
    "qwen3": ("Qwen3Config", dict(num_key_value_heads=2, tie_word_embeddings=False)),
}


def hf_config(case: str, **overrides):
    import transformers
    class_name, options = CASES[case]
    return getattr(transformers, class_name)(**{**SIZES[class_name], "bos_token_id": 1, "eos_token_id": 2, **options,
                                                **overrides})


def hf_model(case: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    import transformers
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(case, **overrides), attn_implementation="eager",
                                                          dtype=torch.float32)
    # Random init is small (and norms start at exactly 1, biases at 0); draw every parameter so that
    # logits are not all near-equal (a clear argmax) and norm scales and biases matter.
    with torch.no_grad():
        for module in model.modules():
            is_norm = isinstance(module, torch.nn.LayerNorm) or type(module).__name__.endswith("RMSNorm")
            weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
            if isinstance(weight, torch.nn.Parameter):
                weight.normal_(1.0, 0.1) if is_norm else weight.normal_(0.0, 0.2)
            if isinstance(bias, torch.nn.Parameter):
                bias.normal_(0.0, 0.05)
    return model.to(dtype).eval()


def make_checkpoint(directory: str | os.PathLike, case: str, seed: int = 0, dtype: torch.dtype = torch.float32,
                    **overrides):
    """Save a tiny random model of `case` as an HF checkpoint dir; returns the transformers model."""
    model = hf_model(case, seed, dtype, **overrides)
    model.save_pretrained(os.fspath(directory), safe_serialization=True)
    return model
