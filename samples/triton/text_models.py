"""The `preprocessing` and `postprocessing` models of the ensemble: text to token ids and word
lists with the engine directory's tokenizer, and token ids back to text (each streamed response
decoded on its own, as the TensorRT-LLM backend's postprocessing does). Text is bounded before it
is tokenized (the serving sample's limit: MAX_CHARS_PER_TOKEN per token of the engine's context)."""
from __future__ import annotations

import numpy as np

from samples.benchmark.cli import model_limits
from samples.real_text import end_ids, load_tokenizer
from samples.serve.openai_basics import MAX_CHARS_PER_TOKEN
from samples.triton.llm_model import read_parameters
from samples.triton.model_configs import ENSEMBLE_TO_PREPROCESSING

PREPROCESSING_TO_ENSEMBLE = {value: key for key, value in ENSEMBLE_TO_PREPROCESSING.items()}


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
        self.max_seq_len = model_limits(read_parameters(model_config)["tokenizer_dir"])[1]
        self.max_text_chars = self.max_seq_len * MAX_CHARS_PER_TOKEN

    def _input(self, request, name: str) -> np.ndarray | None:
        tensor = self.pb_utils.get_input_tensor_by_name(request, name)
        return None if tensor is None else tensor.as_numpy()

    def _texts(self, request, name: str) -> list[str]:
        """A STRING input's texts, refused (naming the ensemble's input too) past the text limit:
        before decoding when its UTF-8 bytes could not fit, else before tokenizing."""
        array = self._input(request, name)
        if array is None:
            return []
        field = f"{PREPROCESSING_TO_ENSEMBLE[name]} ({name})" if name in PREPROCESSING_TO_ENSEMBLE else name
        num_bytes = sum(len(s) if isinstance(s, bytes) else len(str(s)) for s in array.reshape(-1))
        if num_bytes > 4 * self.max_text_chars:   # a character is at most 4 UTF-8 bytes
            raise ValueError(f"{field}: {num_bytes} bytes of text, more than this server's limit of "
                             f"{self.max_text_chars} characters" + self._limit_note())
        try:
            texts = _strings(array)
        except UnicodeDecodeError as e:
            raise ValueError(f"{field}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        num_chars = sum(map(len, texts))
        if num_chars > self.max_text_chars:
            raise ValueError(f"{field}: {num_chars} characters, more than this server's limit of "
                             f"{self.max_text_chars}" + self._limit_note())
        return texts

    def _limit_note(self) -> str:
        return f" ({MAX_CHARS_PER_TOKEN} per token of the model's context of {self.max_seq_len} tokens)"

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
        queries = self._texts(request, "QUERY")
        if len(queries) != 1:
            raise ValueError(f"text_input (QUERY): one text per request, got {len(queries)}")
        input_ids = self.tokenizer.encode(queries[0], add_special_tokens=False)
        if not input_ids:
            raise ValueError("text_input (QUERY): the text has no tokens")
        end_id = self._input(request, "END_ID")
        end_id = int(end_id.reshape(-1)[0]) if end_id is not None else end_ids(self.tokenizer)[0]
        pad_id = self._input(request, "PAD_ID")
        pad_id = int(pad_id.reshape(-1)[0]) if pad_id is not None else (self.tokenizer.pad_token_id or end_id)
        output_len = self._input(request, "REQUEST_OUTPUT_LEN")
        return {"INPUT_ID": np.array([input_ids], dtype=np.int32),
                "REQUEST_INPUT_LEN": np.array([[len(input_ids)]], dtype=np.int32),
                "BAD_WORDS_IDS": word_list(self.tokenizer, self._texts(request, "BAD_WORDS_DICT")),
                "STOP_WORDS_IDS": word_list(self.tokenizer, self._texts(request, "STOP_WORDS_DICT")),
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
