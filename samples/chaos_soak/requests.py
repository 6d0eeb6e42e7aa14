"""Random requests for the chaos soak (`samples.chaos_soak`): greedy, seeded sampling and beam
search, streaming or not, some on LoRA adapters (weights with them, or the task id alone), and bad
requests of every kind of API.md's validation list (unknown adapter ids among them), each with what
the soak expects of it (a `Submission`)."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from batch_manager import InferenceRequest, tensor_names as tn
from runtime.decoding import to_word_list

# The soak's engine limits (chaos_soak.BUILD): prompts and outputs stay well inside them, and a
# beam request fits the KV pool (width * (blocks + 1) <= pool), so only the bad requests fail.
VOCAB_SIZE = 128
MAX_INPUT_LEN = 48
MAX_PROMPT_LEN = 40
MAX_NEW_TOKENS = 24
MAX_BEAM_WIDTH = 4
MAX_BEAM_PROMPT_LEN, MAX_BEAM_NEW_TOKENS = 12, 8
UNKNOWN_ID_BASE = 1 << 40   # stop signals for ids never submitted
# LoRA: the soak's adapters (task id -> (weights [N, W], config int32 [N, 3])), set for its engine
# by the soak; a valid non-beam request uses one at LORA_RATE, bringing its weights half the time
# (else the id alone, which the cache may have evicted: then refused naming lora_task_id).
LORA_ADAPTERS: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
LORA_RATE = 0.2
UNKNOWN_TASK_ID = 999       # never sent with weights


@dataclass
class Submission:
    """One request handed to the manager and what must come back for it."""
    request_id: int
    kind: str                         # "greedy" | "sampled" | "beam" | "bad" | "duplicate"
    prompt: list[int] = field(default_factory=list)
    max_new_tokens: int = 0
    end_id: int = -1
    beam_width: int = 1
    is_streaming: bool = False
    bad_field: str = ""               # "bad": the name the error message must contain
    is_stopped: bool = False          # a stop signal named it while it was active
    is_faulted: bool = False          # a step it was part of raised (fault injection)
    lora_task_id: int | None = None   # its adapter
    lora_id_only: bool = False        # sent without weights: "not in the PEFT cache" is a valid answer
    streamed: list[int] = field(default_factory=list)   # greedy streaming: tokens received so far
    num_responses: int = 0

    @property
    def is_bad(self) -> bool:
        return self.kind in ("bad", "duplicate")


def _i32(*values) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int32)


def word_list(words: list[list[int]]) -> torch.Tensor:
    """TensorRT-LLM's [1, 2, L] request format."""
    return to_word_list(words)[None]


class HostileRequest(InferenceRequest):
    """An InferenceRequest whose `raw_tensors` skip emplace's name and type checks, as a hostile
    client's could: the manager reads a request's tensors through `input_tensors` only."""

    def __init__(self, request_id):
        super().__init__(request_id)
        self.raw_tensors: dict = {}

    @property
    def input_tensors(self) -> dict:
        return {**super().input_tensors, **self.raw_tensors}


def _base(request_id: int, prompt: list[int], max_new_tokens: int, streaming: bool) -> InferenceRequest:
    r = HostileRequest(request_id)
    r.input_ids = torch.tensor(prompt, dtype=torch.int32)
    r.max_new_tokens = torch.tensor([[max_new_tokens]], dtype=torch.int32)
    r.is_streaming = streaming
    return r


def _prompt(rng: random.Random, max_len: int) -> list[int]:
    return [rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randrange(1, max_len + 1))]


def _sampling_tensors(rng: random.Random) -> dict[str, torch.Tensor]:
    t = {"temperature": torch.tensor([rng.uniform(0.3, 1.5)]),
         "random_seed": torch.tensor([rng.randrange(1 << 62)], dtype=torch.int64)}
    if rng.random() < 0.6:
        t["runtime_top_k"] = _i32(rng.randrange(0, 60))
    if rng.random() < 0.6:
        t["runtime_top_p"] = torch.tensor([rng.uniform(0.0, 0.99)])
    if rng.random() < 0.3:
        t["repetition_penalty"] = torch.tensor([rng.uniform(0.8, 1.5)])
    if rng.random() < 0.3:
        t["presence_penalty"] = torch.tensor([rng.uniform(-0.5, 0.5)])
    if rng.random() < 0.3:
        t["frequency_penalty"] = torch.tensor([rng.uniform(-0.5, 0.5)])
    if rng.random() < 0.2:
        t["min_length"] = _i32(rng.randrange(0, 4))
    if rng.random() < 0.15:
        t["stop_words_list"] = word_list([[rng.randrange(3, VOCAB_SIZE)] for _ in range(rng.randrange(1, 3))])
    if rng.random() < 0.15:
        t["bad_words_list"] = word_list([[rng.randrange(3, VOCAB_SIZE), rng.randrange(3, VOCAB_SIZE)]])
    if rng.random() < 0.1:
        t["no_repeat_ngram_size"] = _i32(rng.randrange(1, 4))
    return t


def make_valid(rng: random.Random, request_id: int) -> tuple[InferenceRequest, Submission]:
    """Greedy 50 %, seeded sampling 30 %, beam search 20 %; streaming or not."""
    streaming = rng.random() < 0.5
    kind = rng.choices(["greedy", "sampled", "beam"], [5, 3, 2])[0]
    if kind == "beam":
        prompt, n = _prompt(rng, MAX_BEAM_PROMPT_LEN), rng.randrange(1, MAX_BEAM_NEW_TOKENS + 1)
        width = rng.randrange(2, MAX_BEAM_WIDTH + 1)
        r = _base(request_id, prompt, n, streaming)
        r.beam_width = _i32(width)
        if rng.random() < 0.3:
            r.length_penalty = torch.tensor([rng.uniform(0.0, 1.5)])
        return r, Submission(request_id, kind, prompt, n, beam_width=width, is_streaming=streaming)
    prompt, n = _prompt(rng, MAX_PROMPT_LEN), rng.randrange(1, MAX_NEW_TOKENS + 1)
    r = _base(request_id, prompt, n, streaming)
    end_id = rng.randrange(3, VOCAB_SIZE) if rng.random() < 0.3 else -1
    if end_id >= 0:
        r.end_id = _i32(end_id)
    if kind == "sampled":
        for name, value in _sampling_tensors(rng).items():
            setattr(r, name, value)
    sub = Submission(request_id, kind, prompt, n, end_id=end_id, is_streaming=streaming)
    if LORA_ADAPTERS and rng.random() < LORA_RATE:
        sub.lora_task_id = rng.choice(sorted(LORA_ADAPTERS))
        r.lora_task_id = torch.tensor([sub.lora_task_id], dtype=torch.uint64)
        sub.lora_id_only = rng.random() < 0.5
        if not sub.lora_id_only:
            r.lora_weights, r.lora_config = LORA_ADAPTERS[sub.lora_task_id]
    return r, sub


def _bad_kinds():
    """(name the error must contain, mutation of a valid request) for each kind of bad input."""
    def set_raw(name, value):
        return lambda r: r.raw_tensors.__setitem__(name, value)

    def lora(task_id, weights, config):
        def mutate(r):
            r.lora_task_id = None if task_id is None else torch.tensor([task_id], dtype=torch.uint64)
            r.lora_weights, r.lora_config = weights, config
        return mutate

    row = torch.zeros(1, 4 * 128)   # attn_q of rank 4 on the soak's hidden size 64

    return [
        ("input_ids", lambda r: setattr(r, "input_ids", None)),                          # missing
        ("request_output_len", lambda r: setattr(r, "max_new_tokens", None)),
        ("no_such_tensor", set_raw("no_such_tensor", _i32(1))),                            # unknown name
        ("input_ids", lambda r: setattr(r, "input_ids", torch.tensor([1.0, 2.0]))),       # wrong dtype
        ("input_ids", lambda r: setattr(r, "input_ids", torch.ones(2, 3, dtype=torch.int32))),   # wrong shape
        ("request_output_len", lambda r: setattr(r, "max_new_tokens", torch.ones(1, 2, dtype=torch.int32))),
        ("input_ids", lambda r: setattr(r, "input_ids", torch.zeros(0, dtype=torch.int32))),     # empty
        ("input_ids", lambda r: setattr(r, "input_ids", _i32(5, VOCAB_SIZE))),            # out of vocab
        ("input_ids", lambda r: setattr(r, "input_ids", _i32(-1, 5))),
        ("request_output_len", lambda r: setattr(r, "max_new_tokens", torch.tensor([[0]], dtype=torch.int32))),
        ("request_output_len", lambda r: setattr(r, "max_new_tokens", torch.tensor([[-3]], dtype=torch.int32))),
        ("beam_width", lambda r: setattr(r, "beam_width", _i32(MAX_BEAM_WIDTH + 1))),     # too wide
        ("beam_width", lambda r: setattr(r, "beam_width", _i32(0))),
        ("input_ids", lambda r: setattr(r, "input_ids", _i32(*[5] * (MAX_INPUT_LEN + 1)))),   # too long
        ("temperature", lambda r: setattr(r, "temperature", torch.tensor([float("nan")]))),
        ("runtime_top_p", lambda r: setattr(r, "runtime_top_p", torch.tensor([1.5]))),
        ("runtime_top_k", lambda r: setattr(r, "runtime_top_k", _i32(-2))),
        ("repetition_penalty", lambda r: setattr(r, "repetition_penalty", torch.tensor([0.0]))),
        ("stop_words_list", lambda r: setattr(r, "stop_words_list", _i32(3, 4))),            # not [2, L]
        ("stop_words_list", lambda r: setattr(r, "stop_words_list", torch.tensor([[[5, 6], [2, 1]]],
                                                                                  dtype=torch.int32))),
        ("bad_words_list", lambda r: setattr(r, "bad_words_list", word_list([[VOCAB_SIZE + 3]]))),
        ("bad_words_list", lambda r: setattr(r, "bad_words_list", torch.tensor([[[5.0], [1.0]]]))),
        ("end_id", lambda r: setattr(r, "end_id", _i32(VOCAB_SIZE))),
        ("pad_id", lambda r: setattr(r, "pad_id", torch.tensor([1 << 62], dtype=torch.int64))),
        ("random_seed", lambda r: setattr(r, "random_seed", torch.tensor([0.5]))),
        ("embedding_bias", lambda r: setattr(r, "embedding_bias", torch.zeros(VOCAB_SIZE + 1))),
        ("temperature", set_raw("temperature", 0.7)),                                      # not a tensor
        ("lora_task_id", lora(UNKNOWN_TASK_ID, None, None)),                               # unknown adapter
        ("lora_weights", lora(None, row, _i32(1, 0, 4)[None])),                            # weights, no id
        ("lora_config", lora(UNKNOWN_TASK_ID, row, _i32(1, 99, 4)[None])),                 # no such layer
        ("lora_weights", lora(UNKNOWN_TASK_ID, row[:, :100], _i32(1, 0, 4)[None])),        # row too short
        ("request_id", None),                                                              # negative id
    ]


BAD_KINDS = _bad_kinds()


def make_bad(rng: random.Random, request_id: int) -> tuple[InferenceRequest, Submission]:
    """A bad request of a random kind; a beam-search one for pad_id (beams are padded with it)."""
    bad_field, mutate = rng.choice(BAD_KINDS)
    if mutate is None:
        request_id = -1 - request_id
        mutate = lambda r: None  # noqa: E731
    r, _ = make_valid(rng, request_id)
    if bad_field == "pad_id":
        r.beam_width = _i32(2)
        r.input_ids = _i32(5, 6, 7)
        r.max_new_tokens = torch.tensor([[3]], dtype=torch.int32)
    mutate(r)
    return r, Submission(request_id, "bad", bad_field=bad_field)


def make_duplicate(rng: random.Random, request_id: int) -> tuple[InferenceRequest, Submission]:
    """A valid request whose id is active: it must be refused naming request_id."""
    r, _ = make_valid(rng, request_id)
    return r, Submission(request_id, "duplicate", bad_field="request_id")
