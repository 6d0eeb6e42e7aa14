"""The model configurations (config.pbtxt) of the Triton model repository: the tensors of the
TensorRT-LLM backend's `inflight_batcher_llm` repository with their names, data types and shapes,
written as text for the generic Python backend."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str
    data_type: str            # Triton's TYPE_* name without the prefix: INT32, FP32, BOOL, STRING, ...
    dims: tuple[int, ...]     # per request, without the batch dimension; -1 = any length
    optional: bool = False
    is_scalar: bool = False   # dims [1] reshaped to [] (the backend's scalar inputs)
    is_ragged: bool = False   # allow_ragged_batch


def _scalar(name: str, data_type: str) -> TensorSpec:
    return TensorSpec(name, data_type, (1,), optional=True, is_scalar=True)


LLM_INPUTS = (
    TensorSpec("input_ids", "INT32", (-1,), is_ragged=True),
    TensorSpec("input_lengths", "INT32", (1,), is_scalar=True),
    TensorSpec("request_output_len", "INT32", (1,)),
    TensorSpec("draft_input_ids", "INT32", (-1,), optional=True, is_ragged=True),
    TensorSpec("draft_logits", "FP32", (-1, -1), optional=True, is_ragged=True),
    _scalar("draft_acceptance_threshold", "FP32"),
    _scalar("end_id", "INT32"), _scalar("pad_id", "INT32"),
    TensorSpec("stop_words_list", "INT32", (2, -1), optional=True, is_ragged=True),
    TensorSpec("bad_words_list", "INT32", (2, -1), optional=True, is_ragged=True),
    TensorSpec("embedding_bias", "FP32", (-1,), optional=True, is_ragged=True),
    _scalar("beam_width", "INT32"), _scalar("temperature", "FP32"), _scalar("runtime_top_k", "INT32"),
    _scalar("runtime_top_p", "FP32"), _scalar("runtime_top_p_min", "FP32"), _scalar("runtime_top_p_decay", "FP32"),
    _scalar("runtime_top_p_reset_ids", "INT32"), _scalar("len_penalty", "FP32"), _scalar("early_stopping", "BOOL"),
    _scalar("repetition_penalty", "FP32"), _scalar("min_length", "INT32"),
    _scalar("beam_search_diversity_rate", "FP32"), _scalar("presence_penalty", "FP32"),
    _scalar("frequency_penalty", "FP32"), _scalar("random_seed", "UINT64"), _scalar("return_log_probs", "BOOL"),
    _scalar("return_context_logits", "BOOL"), _scalar("return_generation_logits", "BOOL"),
    TensorSpec("stop", "BOOL", (1,), optional=True),
    TensorSpec("streaming", "BOOL", (1,), optional=True),
    TensorSpec("prompt_embedding_table", "FP16", (-1, -1), optional=True, is_ragged=True),
    _scalar("prompt_vocab_size", "INT32"),
    _scalar("lora_task_id", "UINT64"),
    TensorSpec("lora_weights", "FP16", (-1, -1), optional=True, is_ragged=True),
    TensorSpec("lora_config", "INT32", (-1, 3), optional=True, is_ragged=True),
)
LLM_OUTPUTS = (
    TensorSpec("output_ids", "INT32", (-1, -1)), TensorSpec("sequence_length", "INT32", (-1,)),
    TensorSpec("cum_log_probs", "FP32", (-1,)), TensorSpec("output_log_probs", "FP32", (-1, -1)),
    TensorSpec("context_logits", "FP32", (-1, -1)), TensorSpec("generation_logits", "FP32", (-1, -1, -1)),
)

PREPROCESSING_INPUTS = (
    TensorSpec("QUERY", "STRING", (-1,)), TensorSpec("REQUEST_OUTPUT_LEN", "INT32", (-1,)),
    TensorSpec("BAD_WORDS_DICT", "STRING", (-1,), optional=True),
    TensorSpec("STOP_WORDS_DICT", "STRING", (-1,), optional=True),
    TensorSpec("END_ID", "INT32", (1,), optional=True), TensorSpec("PAD_ID", "INT32", (1,), optional=True),
)
PREPROCESSING_OUTPUTS = (
    TensorSpec("INPUT_ID", "INT32", (-1,)), TensorSpec("REQUEST_INPUT_LEN", "INT32", (1,)),
    TensorSpec("BAD_WORDS_IDS", "INT32", (2, -1)), TensorSpec("STOP_WORDS_IDS", "INT32", (2, -1)),
    TensorSpec("REQUEST_OUTPUT_LEN", "INT32", (-1,)),
    TensorSpec("OUT_END_ID", "INT32", (1,)), TensorSpec("OUT_PAD_ID", "INT32", (1,)),
)
POSTPROCESSING_INPUTS = (
    TensorSpec("TOKENS_BATCH", "INT32", (-1, -1)), TensorSpec("SEQUENCE_LENGTH", "INT32", (-1,)),
    TensorSpec("CUM_LOG_PROBS", "FP32", (-1,), optional=True),
    TensorSpec("OUTPUT_LOG_PROBS", "FP32", (-1, -1), optional=True),
)
POSTPROCESSING_OUTPUTS = (
    TensorSpec("OUTPUT", "STRING", (-1,)), TensorSpec("OUT_CUM_LOG_PROBS", "FP32", (-1,)),
    TensorSpec("OUT_OUTPUT_LOG_PROBS", "FP32", (-1, -1)),
)

# The ensemble's text interface; the maps below say which model each input feeds.
ENSEMBLE_INPUTS = (
    TensorSpec("text_input", "STRING", (-1,)), TensorSpec("max_tokens", "INT32", (-1,)),
    TensorSpec("bad_words", "STRING", (-1,), optional=True), TensorSpec("stop_words", "STRING", (-1,), optional=True),
    TensorSpec("end_id", "INT32", (1,), optional=True), TensorSpec("pad_id", "INT32", (1,), optional=True),
    TensorSpec("top_k", "INT32", (1,), optional=True), TensorSpec("top_p", "FP32", (1,), optional=True),
    TensorSpec("temperature", "FP32", (1,), optional=True), TensorSpec("length_penalty", "FP32", (1,), optional=True),
    TensorSpec("repetition_penalty", "FP32", (1,), optional=True),
    TensorSpec("min_length", "INT32", (1,), optional=True),
    TensorSpec("presence_penalty", "FP32", (1,), optional=True),
    TensorSpec("frequency_penalty", "FP32", (1,), optional=True),
    TensorSpec("random_seed", "UINT64", (1,), optional=True), TensorSpec("return_log_probs", "BOOL", (1,), optional=True),
    TensorSpec("beam_width", "INT32", (1,), optional=True), TensorSpec("stream", "BOOL", (1,), optional=True),
)
ENSEMBLE_OUTPUTS = (
    TensorSpec("text_output", "STRING", (-1,)), TensorSpec("cum_log_probs", "FP32", (-1,)),
    TensorSpec("output_log_probs", "FP32", (-1, -1)),
)
# ensemble input -> tensorrt_llm input, for those that go straight to the LLM
ENSEMBLE_TO_LLM = {"top_k": "runtime_top_k", "top_p": "runtime_top_p", "temperature": "temperature",
                   "length_penalty": "len_penalty", "repetition_penalty": "repetition_penalty",
                   "min_length": "min_length", "presence_penalty": "presence_penalty",
                   "frequency_penalty": "frequency_penalty", "random_seed": "random_seed",
                   "return_log_probs": "return_log_probs", "beam_width": "beam_width", "stream": "streaming"}
# ensemble input -> preprocessing input
ENSEMBLE_TO_PREPROCESSING = {"text_input": "QUERY", "max_tokens": "REQUEST_OUTPUT_LEN", "bad_words": "BAD_WORDS_DICT",
                             "stop_words": "STOP_WORDS_DICT", "end_id": "END_ID", "pad_id": "PAD_ID"}
# preprocessing output -> tensorrt_llm input
PREPROCESSING_TO_LLM = {"INPUT_ID": "input_ids", "REQUEST_INPUT_LEN": "input_lengths",
                        "REQUEST_OUTPUT_LEN": "request_output_len", "BAD_WORDS_IDS": "bad_words_list",
                        "STOP_WORDS_IDS": "stop_words_list", "OUT_END_ID": "end_id", "OUT_PAD_ID": "pad_id"}
# tensorrt_llm output -> postprocessing input
LLM_TO_POSTPROCESSING = {"output_ids": "TOKENS_BATCH", "sequence_length": "SEQUENCE_LENGTH",
                         "cum_log_probs": "CUM_LOG_PROBS", "output_log_probs": "OUTPUT_LOG_PROBS"}
POSTPROCESSING_TO_ENSEMBLE = {"OUTPUT": "text_output", "OUT_CUM_LOG_PROBS": "cum_log_probs",
                              "OUT_OUTPUT_LOG_PROBS": "output_log_probs"}


def _tensor_block(spec: TensorSpec) -> str:
    lines = [f'    name: "{spec.name}"', f"    data_type: TYPE_{spec.data_type}",
             f"    dims: [ {', '.join(map(str, spec.dims))} ]"]
    if spec.is_scalar:
        lines.append("    reshape: { shape: [ ] }")
    if spec.optional:
        lines.append("    optional: true")
    if spec.is_ragged:
        lines.append("    allow_ragged_batch: true")
    return "  {\n" + "\n".join(lines) + "\n  }"


def _tensors(kind: str, specs) -> str:
    return f"{kind} [\n" + ",\n".join(_tensor_block(s) for s in specs) + "\n]\n"


def _parameters(parameters: dict[str, str]) -> str:
    return "".join(f'parameters: {{\n  key: "{key}"\n  value: {{\n    string_value: "{value}"\n  }}\n}}\n'
                   for key, value in parameters.items())


def python_model_config(name: str, inputs, outputs, parameters: dict[str, str], max_batch_size: int,
                        is_decoupled: bool = False, num_instances: int = 1) -> str:
    text = f'name: "{name}"\nbackend: "python"\nmax_batch_size: {max_batch_size}\n'
    if is_decoupled:
        text += "model_transaction_policy {\n  decoupled: true\n}\n"
    text += _tensors("input", inputs) + _tensors("output", outputs)
    text += f"instance_group [\n  {{\n    count: {num_instances}\n    kind: KIND_CPU\n  }}\n]\n"
    return text + _parameters(parameters)


def _step(model: str, input_map: dict[str, str], output_map: dict[str, str]) -> str:
    """One ensemble step; the maps are model tensor -> ensemble tensor."""
    inputs = "".join(f'      input_map {{\n        key: "{k}"\n        value: "{v}"\n      }}\n' for k, v in input_map.items())
    outputs = "".join(f'      output_map {{\n        key: "{k}"\n        value: "{v}"\n      }}\n'
                      for k, v in output_map.items())
    return f'    {{\n      model_name: "{model}"\n      model_version: -1\n{inputs}{outputs}    }}'


def ensemble_config(max_batch_size: int) -> str:
    preprocessing = _step("preprocessing", {v: k for k, v in ENSEMBLE_TO_PREPROCESSING.items()},
                          {k: f"_{k}" for k in PREPROCESSING_TO_LLM})
    llm_inputs = {v: f"_{k}" for k, v in PREPROCESSING_TO_LLM.items()}
    llm_inputs.update({v: k for k, v in ENSEMBLE_TO_LLM.items()})
    llm = _step("tensorrt_llm", llm_inputs, {k: f"_{k}" for k in LLM_TO_POSTPROCESSING})
    postprocessing = _step("postprocessing", {v: f"_{k}" for k, v in LLM_TO_POSTPROCESSING.items()},
                           POSTPROCESSING_TO_ENSEMBLE)
    return (f'name: "ensemble"\nplatform: "ensemble"\nmax_batch_size: {max_batch_size}\n'
            + _tensors("input", ENSEMBLE_INPUTS) + _tensors("output", ENSEMBLE_OUTPUTS)
            + "ensemble_scheduling {\n  step [\n" + ",\n".join((preprocessing, llm, postprocessing)) + "\n  ]\n}\n")
