"""transformers' model on the same weights as one of our model directories: an HF checkpoint
directory, a GGUF file, or an engine directory built from a GGUF (its `source.json` names the file)."""
from __future__ import annotations

import json
import os

import torch

SOURCE_FILE = "source.json"   # written beside an engine built from a GGUF: {"gguf": path}


def gguf_source(model_dir: str) -> str | None:
    """The GGUF file `model_dir` is, or was built from; None for anything else."""
    if model_dir.endswith(".gguf"):
        return model_dir
    path = os.path.join(model_dir, SOURCE_FILE)
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f).get("gguf")
    return None


def load_reference_model(model_dir: str, attn_implementation: str | None = "eager"):
    """transformers' float32 model of `model_dir` in eval mode (None: transformers' default attention)."""
    import transformers
    kwargs = dict(dtype=torch.float32, attn_implementation=attn_implementation)
    gguf = gguf_source(model_dir)
    if gguf is not None:
        model = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf),
                                                                  gguf_file=os.path.basename(gguf), **kwargs)
    elif os.path.exists(os.path.join(model_dir, "config.json")):
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    else:
        raise ValueError(f"{model_dir!r}: transformers cannot load it (neither an HF checkpoint, a GGUF file, "
                         "nor an engine directory built from one)")
    return model.eval()
