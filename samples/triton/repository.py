"""Writes the Triton model repository: `tensorrt_llm` (decoupled, one GptManager per instance)
and, where the engine directory holds a tokenizer, `preprocessing`, `postprocessing` and
`ensemble`, in the layout and with the tensor names of the TensorRT-LLM backend's
`inflight_batcher_llm` repository."""
from __future__ import annotations

import dataclasses
import os
import shutil

from samples.triton import model_configs as mc

ENTRY_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model_entry.py")


@dataclasses.dataclass(frozen=True)
class RepositoryOptions:
    max_batch_size: int = 64                      # Triton's per-model limit (one sequence per request here)
    gpt_model_type: str = "inflight_fused_batching"
    batch_scheduler_policy: str = "guaranteed_no_evict"
    max_beam_width: int = 1
    max_tokens_in_paged_kv_cache: int | None = None
    enable_kv_cache_reuse: bool = False
    enable_chunked_context: bool = False
    exclude_input_in_output: bool = True
    cancellation_check_period_ms: int = 100
    num_text_instances: int = 1                   # instances of preprocessing / postprocessing


DRAIN_FILE = "draining"   # in the tensorrt_llm model's directory; written by the launcher on shutdown
DRAINED_FILE = "drained"  # beside it; written by the model once every request got its final response


def drain_file(repository: str) -> str:
    return os.path.join(os.path.abspath(repository), "tensorrt_llm", DRAIN_FILE)


def drained_file(repository: str) -> str:
    return os.path.join(os.path.abspath(repository), "tensorrt_llm", DRAINED_FILE)


def _llm_parameters(engine_dir: str, options: RepositoryOptions) -> dict[str, str]:
    parameters = {"gpt_model_type": options.gpt_model_type, "gpt_model_path": engine_dir,
                  "batch_scheduler_policy": options.batch_scheduler_policy,
                  "max_beam_width": str(options.max_beam_width),
                  "enable_kv_cache_reuse": str(options.enable_kv_cache_reuse).lower(),
                  "enable_chunked_context": str(options.enable_chunked_context).lower(),
                  "exclude_input_in_output": str(options.exclude_input_in_output).lower(),
                  "cancellation_check_period_ms": str(options.cancellation_check_period_ms)}
    if options.max_tokens_in_paged_kv_cache is not None:
        parameters["max_tokens_in_paged_kv_cache"] = str(options.max_tokens_in_paged_kv_cache)
    return parameters


def has_tokenizer(engine_dir: str) -> bool:
    return os.path.exists(os.path.join(engine_dir, "tokenizer.json"))


def write_repository(directory: str, engine_dir: str, python_path: tuple[str, ...],
                     options: RepositoryOptions = RepositoryOptions()) -> list[str]:
    """Writes (over) the repository in `directory`; returns the model names."""
    engine_dir = os.path.abspath(engine_dir)
    common = {"python_path": os.pathsep.join(python_path)}
    models = {"tensorrt_llm": mc.python_model_config(
        "tensorrt_llm", mc.LLM_INPUTS, mc.LLM_OUTPUTS,
        {**common, "implementation": "samples.triton.llm_model:LlmModel", "drain_file": drain_file(directory),
         "drained_file": drained_file(directory),
         **_llm_parameters(engine_dir, options)},
        options.max_batch_size, is_decoupled=True)}
    if has_tokenizer(engine_dir):
        text = {**common, "tokenizer_dir": engine_dir}
        models["preprocessing"] = mc.python_model_config(
            "preprocessing", mc.PREPROCESSING_INPUTS, mc.PREPROCESSING_OUTPUTS,
            {**text, "implementation": "samples.triton.text_models:Preprocessing"}, options.max_batch_size,
            num_instances=options.num_text_instances)
        models["postprocessing"] = mc.python_model_config(
            "postprocessing", mc.POSTPROCESSING_INPUTS, mc.POSTPROCESSING_OUTPUTS,
            {**text, "implementation": "samples.triton.text_models:Postprocessing"}, options.max_batch_size,
            num_instances=options.num_text_instances)
        models["ensemble"] = mc.ensemble_config(options.max_batch_size)
    for path in (drain_file(directory), drained_file(directory)):
        if os.path.exists(path):
            os.remove(path)
    for name, config in models.items():
        version_dir = os.path.join(directory, name, "1")
        os.makedirs(version_dir, exist_ok=True)
        with open(os.path.join(directory, name, "config.pbtxt"), "w") as f:
            f.write(config)
        if name != "ensemble":
            shutil.copyfile(ENTRY_FILE, os.path.join(version_dir, "model.py"))
    return list(models)
