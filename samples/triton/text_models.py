"""The `preprocessing` and `postprocessing` models of the ensemble: text to token ids and word
lists with the engine directory's tokenizer, and token ids back to text (each streamed response
decoded on its own, as the TensorRT-LLM backend's postprocessing does)."""
from __future__ import annotations

import numpy as np

from samples.real_text import end_ids, load_tokenizer
from samples.triton.llm_model import read_parameters


def _strings(array: np.ndarray | None) -> list[str]:
    if array is None:
        return []
    return [s.decode("utf-8") if isinstance(s, bytes) else str(s) for s in array.reshape(-1)]


def word_list(tokenizer, words: list[str]) -> np.ndarray:
    """words -> int32 [1, 2, L]: row 0 the words' ids one after another, row 1 the end offset of
    each word, padded with -1 ([[0], [-1]] for no words)."""
    ids, offsets = [], []
    for word in words:
        if word:
            ids.extend(tokenizer.encode(word, add_special_tokens=False))
            offsets.append(len(ids))
    if not ids:
        return np.array([[[0], [-1]]], dtype=np.int32)
    rows = np.full((1, 2, len(ids)), -1, dtype=np.int32)
    rows[0, 0] = ids
    rows[0, 1, :len(offsets)] = offsets
    return rows


class TextModel:
    """What the two share: the tokenizer and the loop over a batch of requests."""

    def __init__(self, pb_utils, model_config: dict, model_name: str, model_version: str):
        self.pb_utils = pb_utils
        self.tokenizer = load_tokenizer(read_parameters(model_config)["tokenizer_dir"])

    def _input(self, request, name: str) -> np.ndarray | None:
        tensor = self.pb_utils.get_input_tensor_by_name(request, name)
        return None if tensor is None else tensor.as_numpy()

    def execute(self, requests) -> list:
        responses = []
        for request in requests:
            try:
                outputs = self.outputs(request)
                responses.append(self.pb_utils.InferenceResponse(
                    output_tensors=[self.pb_utils.Tensor(name, value) for name, value in outputs.items()]))
            except ValueError as e:
                responses.append(self.pb_utils.InferenceResponse(error=self.pb_utils.TritonError(str(e))))
        return responses

    def finalize(self) -> None:
        pass


class Preprocessing(TextModel):
    def outputs(self, request) -> dict[str, np.ndarray]:
        queries = _strings(self._input(request, "QUERY"))
        if len(queries) != 1:
            raise ValueError(f"QUERY: one text per request, got {len(queries)}")
        input_ids = self.tokenizer.encode(queries[0], add_special_tokens=False)
        if not input_ids:
            raise ValueError("QUERY: the text has no tokens")
        end_id = self._input(request, "END_ID")
        end_id = int(end_id.reshape(-1)[0]) if end_id is not None else end_ids(self.tokenizer)[0]
        pad_id = self._input(request, "PAD_ID")
        pad_id = int(pad_id.reshape(-1)[0]) if pad_id is not None else (self.tokenizer.pad_token_id or end_id)
        output_len = self._input(request, "REQUEST_OUTPUT_LEN")
        return {"INPUT_ID": np.array([input_ids], dtype=np.int32),
                "REQUEST_INPUT_LEN": np.array([[len(input_ids)]], dtype=np.int32),
                "BAD_WORDS_IDS": word_list(self.tokenizer, _strings(self._input(request, "BAD_WORDS_DICT"))),
                "STOP_WORDS_IDS": word_list(self.tokenizer, _strings(self._input(request, "STOP_WORDS_DICT"))),
                "REQUEST_OUTPUT_LEN": output_len.reshape(1, -1)[:, :1].astype(np.int32),
                "OUT_END_ID": np.array([[end_id]], dtype=np.int32), "OUT_PAD_ID": np.array([[pad_id]], dtype=np.int32)}


class Postprocessing(TextModel):
    def outputs(self, request) -> dict[str, np.ndarray]:
        tokens = self._input(request, "TOKENS_BATCH")            # [1, beam, T]
        lengths = self._input(request, "SEQUENCE_LENGTH")        # [1, beam]
        texts = [self.tokenizer.decode(tokens[0, beam, :lengths[0, beam]].tolist(), skip_special_tokens=True)
                 for beam in range(tokens.shape[1])]
        cum_log_probs = self._input(request, "CUM_LOG_PROBS")
        output_log_probs = self._input(request, "OUTPUT_LOG_PROBS")
        return {"OUTPUT": np.array([[t.encode("utf-8") for t in texts]], dtype=np.object_),
                "OUT_CUM_LOG_PROBS": (cum_log_probs if cum_log_probs is not None
                                      else np.zeros((1, tokens.shape[1]), np.float32)),
                "OUT_OUTPUT_LOG_PROBS": (output_log_probs if output_log_probs is not None
                                         else np.zeros((1, tokens.shape[1], 0), np.float32))}
