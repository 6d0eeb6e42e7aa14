"""Which GGML type each tensor of a GGUF file gets, the way llama.cpp's quantizer chooses it
(`llama_tensor_get_type` in src/llama-quant.cpp), for the files the benchmarks write: a plain type
(Q8_0, Q4_0, Q4_1, Q5_0, Q6_K, ...) for every 2-D weight, or the Q4_K_M recipe (Q4_K for most
tensors; Q6_K for the output, for attn_v and ffn_down in the layers `use_more_bits` picks).

A K type needs rows that are a multiple of 256 values: on narrower tensors (SmolLM2's 576 columns)
llama.cpp falls back (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0), and so do these recipes, so that a
"Q4_K_M" file of SmolLM2 is what llama-quantize writes: mostly Q5_0 and Q8_0, Q4_K / Q6_K only
where the columns allow (ffn_down).
"""
from __future__ import annotations

import re

import gguf

QK_K = 256
K_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
RECIPES = ("Q4_K_M",)
_LAYER = re.compile(r"^blk\.(\d+)\.")


def use_more_bits(index: int, count: int) -> bool:
    """llama.cpp's rule for the layers a *_M recipe gives more bits: the first and last eighth, and
    every third layer between."""
    return index < count // 8 or index >= 7 * count // 8 or (index - count // 8) % 3 == 2


def tensor_type(name: str, columns: int, recipe: str, num_layers: int, has_output: bool) -> str:
    """The GGML type name of 2-D tensor `name` (GGUF naming) with rows of `columns` values under
    `recipe` (a plain type name or one of RECIPES); `has_output`: the file has its own output.weight
    (else a tied token_embd is treated as the output, as llama.cpp does)."""
    if recipe == "Q4_K_M":
        is_output = name == "output.weight" or (not has_output and name == "token_embd.weight")
        match = _LAYER.match(name)
        if is_output:
            chosen = "Q6_K"
        elif match and (".attn_v." in name or ".ffn_down." in name):
            chosen = "Q6_K" if use_more_bits(int(match.group(1)), num_layers) else "Q4_K"
        else:
            chosen = "Q4_K"
    elif recipe in gguf.GGMLQuantizationType.__members__:
        chosen = recipe
    else:
        raise ValueError(f"recipe: {recipe!r} is neither a GGML type nor one of {RECIPES}")
    if chosen in K_FALLBACK and columns % QK_K:
        return K_FALLBACK[chosen]
    return chosen


def file_type_name(recipe: str) -> str:
    """The `gguf.LlamaFileType` member a file of `recipe` declares (general.file_type)."""
    if recipe == "F32":
        return "ALL_F32"
    if recipe in ("Q4_K", "Q5_K"):   # Q4_K / Q5_K alone are llama.cpp's *_K_S recipes
        return f"MOSTLY_{recipe}_S"
    return f"MOSTLY_{recipe}"
