"""The one table of a request's scalar sampling settings and the name each front door gives them.

Every front door converts through it: GptManager's request tensors (batch_manager.legacy.admission),
the Executor's `SamplingConfig` / `OutputConfig` (batch_manager.executor.conversion), GptSession's
`SamplingConfig` (runtime.session) and the serving sample's JSON body (samples.serve). A value
left unset (None, or a tensor not sent) is the field's default, written once: `DecodingParams`'.

Adding a sampling option: the field on DecodingParams (with its bounds there), its kernel, one row
here, and at most one line per front door that spells its own attributes (the Executor's and
GptSession's SamplingConfig signatures, the tensor-name constant).

`end_id`, word lists, the embedding bias, `normalize_log_probs` and `num_top_log_probs` at
GptSession are per request or per batch, not per-sequence scalars: each front door sets them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .params import DecodingParams

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(DecodingParams)}


@dataclass(frozen=True)
class SamplingField:
    param: str                  # the DecodingParams field
    tensor: str                 # GptManager's request tensor (batch_manager.legacy.tensor_names)
    executor: str | None        # the Executor's attribute ("output_config.x" outside SamplingConfig)
    session: str | None         # GptSession's SamplingConfig attribute (None: not settable there)
    body: str | None            # the serving sample's JSON field (None: not accepted there)

    @property
    def default(self) -> int | float:
        return _DEFAULTS[self.param]

    @property
    def kind(self) -> str:
        """"int" or "float", from the default's type."""
        return "int" if isinstance(self.default, int) else "float"

    @property
    def executor_sampling(self) -> str | None:
        """The Executor SamplingConfig attribute (None when the field lives elsewhere)."""
        return self.executor if self.executor is not None and "." not in self.executor else None


def _row(param: str, tensor: str | None = None, executor: str | None = "", session: str | None = "",
         body: str | None = "") -> SamplingField:
    """A row whose names default to the field's own ("" = the tensor's, else the param's name)."""
    return SamplingField(param, tensor or param, param if executor == "" else executor,
                         param if session == "" else session, (tensor or param) if body == "" else body)


SAMPLING_FIELDS: tuple[SamplingField, ...] = (
    _row("beam_width", session=None),   # GptSession: one beam width for the batch, not per sequence
    _row("temperature"),
    _row("top_k", "runtime_top_k", body="top_k"),
    _row("top_p", "runtime_top_p", body="top_p"),
    _row("top_p_decay"),
    _row("top_p_min"),
    _row("top_p_reset_id", "top_p_reset_ids", executor="top_p_reset_ids", session="top_p_reset_ids"),
    _row("min_p"),
    _row("num_top_log_probs", executor="output_config.num_top_log_probs", session=None),
    # the serving sample: OpenAI's `n` is its own (openai_choices), /generate returns one sequence
    _row("num_return_sequences", session=None, body=None),
    _row("min_length", executor="min_tokens"),
    _row("repetition_penalty"),
    _row("presence_penalty"),
    _row("frequency_penalty"),
    _row("no_repeat_ngram_size", "noRepeatNgramSize", body="no_repeat_ngram_size"),   # the legacy spellings
    _row("length_penalty", "len_penalty", body="length_penalty"),
    _row("early_stopping"),
    _row("diversity_rate", "beam_search_diversity_rate", executor="beam_search_diversity_rate",
         session="beam_search_diversity_rate"),
    _row("random_seed", executor="seed", body="seed"),
)
BY_PARAM = {f.param: f for f in SAMPLING_FIELDS}
