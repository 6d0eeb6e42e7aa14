"""Two real-text workloads of samples.quality: prompt lookup on prompts whose answer copies them
(acceptance and speedup at one request, outputs unchanged), and a JSON-schema guided answer."""
from __future__ import annotations

import json

from batch_manager.executor import (Executor, ExecutorConfig, GuidedDecodingConfig, GuidedDecodingParams, GuideType,
                                    ModelType, OutputConfig, Request)
from samples.microbench.prompt_lookup import serve

CAPITAL_SCHEMA = {
    "type": "object",
    "properties": {"country": {"type": "string"}, "capital": {"type": "string"},
                   "continent": {"type": "string", "enum": ["Africa", "Asia", "Europe", "North America",
                                                            "Oceania", "South America"]}},
    "required": ["country", "capital", "continent"], "additionalProperties": False,
}
GUIDED_QUESTION = "What is the capital of France? Answer in JSON with the country, its capital and its continent."


def prompt_lookup(model_dir: str, prompts: list[list[int]], num_tokens: int, lookup: int) -> dict:
    """The prompts one at a time (concurrency 1), without and with prompt-lookup drafts."""
    off = serve(model_dir, prompts, num_tokens, 0, 1)
    on = serve(model_dir, prompts, num_tokens, lookup, 1)
    return {"num_prompts": len(prompts), "new_tokens_per_prompt": num_tokens, "lookup": lookup,
            "off_tok_s": off["tokens_per_s"], "on_tok_s": on["tokens_per_s"],
            "speedup": on["tokens_per_s"] / off["tokens_per_s"], "acceptance": on["acceptance"],
            "proposed": on["proposed"], "accepted": on["accepted"],
            "outputs_equal": on["outputs"] == off["outputs"]}


def guided_json(model_dir: str, prompt: list[int], tokenizer, max_tokens: int = 96) -> dict:
    """One greedy request guided by CAPITAL_SCHEMA: its text, and whether it parses and fits."""
    config = ExecutorConfig(guided_decoding_config=GuidedDecodingConfig.from_tokenizer(model_dir))
    with Executor(model_dir, ModelType.DECODER_ONLY, config) as executor:
        request_id = executor.enqueue_request(Request(
            prompt, max_tokens, output_config=OutputConfig(exclude_input_from_output=True),
            guided_decoding_params=GuidedDecodingParams(GuideType.JSON_SCHEMA, json.dumps(CAPITAL_SCHEMA))))
        response = None
        while response is None or not response.result.is_final:
            for response in executor.await_responses(request_id, timeout=600.0):
                if response.has_error():
                    raise RuntimeError(f"guided request: {response.error_msg}")
    tokens = [t for t in response.result.output_token_ids[0] if t not in config.guided_decoding_config.stop_token_ids]
    text = tokenizer.decode(tokens)
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    valid = isinstance(value, dict) and set(value) == set(CAPITAL_SCHEMA["required"]) and \
        value["continent"] in CAPITAL_SCHEMA["properties"]["continent"]["enum"]
    return {"text": text, "valid_json": value is not None, "fits_schema": valid,
            "finish_reason": response.result.finish_reasons[0].name}
