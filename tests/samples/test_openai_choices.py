"""samples.serve.openai_choices over a scripted bridge (no engine): n choices of a prompt are one
engine request (its samples) unless top log probs are asked, responses queued after a stop string
ended their choice are dropped, a shared request is stopped once all its choices ended, errors map
to their statuses, close() cancels exactly the unfinished requests, a refused submit leaves nothing
running."""
from __future__ import annotations

import asyncio

import pytest

from batch_manager.executor import QueueFullError
from samples.serve.bridge import SHUTTING_DOWN, VALIDATION_ERROR_PREFIX, ResponseEvent
from samples.serve.openai_choices import ChoiceRun
from samples.serve.openai_basics import ModelInfo, OpenAIError
from samples.serve.openai_protocol import parse_request
from samples.serve.params import GenerateParams
from tests.samples.scripted_model import VOCAB_SIZE, write_tokenizer


@pytest.fixture(scope="module")
def info(tmp_path_factory):
    import transformers
    directory = str(tmp_path_factory.mktemp("bpe"))
    write_tokenizer(directory)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
    return ModelInfo("m", tokenizer, VOCAB_SIZE, 64, tokenizer.eos_token_id)


class ScriptedBridge:
    """submit() hands out ids and queues; the test puts the responses; cancel() is recorded.
    Requests are built as ManagerBridge builds them (GptManager's tensors)."""
    build = staticmethod(GenerateParams.to_inference_request)

    def __init__(self, refuse_after: int | None = None, refusal: Exception | None = None):
        self.queues: dict[int, asyncio.Queue] = {}
        self.bodies: list = []
        self.num_samples: list[int] = []
        self.cancelled: list[int] = []
        self.refuse_after, self.refusal = refuse_after, refusal
        self.metrics = None

    def submit(self, make_request, return_log_probs, loop, num_samples=1):
        if self.refuse_after is not None and len(self.queues) >= self.refuse_after:
            raise self.refusal
        request_id = len(self.queues) + 1
        self.bodies.append(make_request(request_id))
        self.num_samples.append(num_samples)
        self.queues[request_id] = asyncio.Queue()
        return request_id, self.queues[request_id]

    def cancel(self, request_id: int) -> None:
        self.cancelled.append(request_id)


def ids(info, text: str) -> list[int]:
    return info.tokenizer.encode(text, add_special_tokens=False)


def spec(info, **fields):
    return parse_request({"model": "m", "prompt": "Say:", "max_tokens": 20, **fields}, False, info)


def test_n_choices_are_one_request_and_late_responses_after_a_stop_string_are_dropped(info):
    async def scenario(first_done: int):
        bridge = ScriptedBridge()
        run = ChoiceRun(bridge, spec(info, n=2, stop="lo", seed=5), info, None)
        run.submit()
        hi = ResponseEvent(ids(info, "Hi"), True, sequence_index=1)
        if first_done == 1:
            bridge.queues[1].put_nowait(hi)
        for t in ids(info, "Hello world"):   # choice 0 streams past its stop string before anyone reads
            bridge.queues[1].put_nowait(ResponseEvent([t], False, sequence_index=0))
        updates = [await run.next_update() for _ in range(len(ids(info, "Hello")) + (first_done == 1))]
        cancelled_at_stop = list(bridge.cancelled)
        if first_done == 0:
            bridge.queues[1].put_nowait(hi)
        while not run.is_done:
            updates.append(await run.next_update())
        run.close()
        return bridge, run, cancelled_at_stop

    for first_done in (0, 1):
        bridge, run, cancelled_at_stop = asyncio.run(scenario(first_done))
        assert ["".join(c.text) for c in run.choices] == ["Hel", "Hi"]
        assert [c.finish_reason for c in run.choices] == ["stop", "stop"]
        assert run.choices[0].num_tokens == len(ids(info, "Hello"))   # up to the token completing "lo"
        # one engine request of 2 samples, seeded 5 (sample j draws with 5 + j)
        assert bridge.num_samples == [2] and [b.input_tensors["random_seed"].item() for b in bridge.bodies] == [5]
        assert bridge.bodies[0].input_tensors["num_return_sequences"].item() == 2
        # stopped once both choices ended: at the stop string if choice 1 had ended first, else never
        assert cancelled_at_stop == ([1] if first_done == 1 else []) and bridge.cancelled == cancelled_at_stop


def test_top_log_probs_take_one_request_per_choice(info):
    async def scenario():
        bridge = ScriptedBridge()
        run = ChoiceRun(bridge, spec(info, n=2, seed=5, logprobs=2), info, None)
        run.submit()
        run.close()
        return bridge

    bridge = asyncio.run(scenario())
    assert bridge.num_samples == [1, 1] and [b.input_tensors["random_seed"].item() for b in bridge.bodies] == [5, 6]


@pytest.mark.parametrize("error, status", [
    (VALIDATION_ERROR_PREFIX + ": request 1: request_output_len: 0 must be positive", 400),
    (SHUTTING_DOWN, 503),
    ("model step failed: out of memory", 500),
])
def test_error_responses_map_to_statuses(info, error, status):
    async def scenario():
        bridge = ScriptedBridge()
        run = ChoiceRun(bridge, spec(info, prompt=["Say:"] * 3), info, None)
        run.submit()
        bridge.queues[2].put_nowait(ResponseEvent([], True, error))
        with pytest.raises(OpenAIError) as e:
            await run.next_update()
        run.close()
        return bridge, e.value

    bridge, e = asyncio.run(scenario())
    assert e.status == status
    if status == 400:
        assert e.param == "max_tokens" and e.message.startswith("max_tokens: ")
    assert sorted(bridge.cancelled) == [1, 2, 3]


@pytest.mark.parametrize("refusal, status", [(QueueFullError("the request queue is full"), 429),
                                             (RuntimeError(SHUTTING_DOWN), 503),
                                             (ValueError("top_k: -3 must be >= 0"), 400)])
def test_a_refused_submit_cancels_the_choices_already_queued(info, refusal, status):
    async def scenario():
        bridge = ScriptedBridge(refuse_after=2, refusal=refusal)
        run = ChoiceRun(bridge, spec(info, prompt=["Say:"] * 4), info, None)
        with pytest.raises(OpenAIError) as e:
            run.submit()
        return bridge, e.value

    bridge, e = asyncio.run(scenario())
    assert e.status == status and sorted(bridge.cancelled) == [1, 2]


@pytest.mark.parametrize("per_request, num_samples", [(64, [64, 64]), (48, [48, 48, 32]), (128, [64, 64])])
def test_n_past_the_engines_samples_per_request_is_split(info, per_request, num_samples):
    import dataclasses
    capped = dataclasses.replace(info, max_samples_per_request=min(per_request, 64))

    async def scenario():
        bridge = ScriptedBridge()
        run = ChoiceRun(bridge, spec(capped, n=128, seed=5), capped, None)
        run.submit()
        run.close()
        return bridge, run

    bridge, run = asyncio.run(scenario())
    assert bridge.num_samples == num_samples and len(run.choices) == 128
    starts = [sum(num_samples[:k]) for k in range(len(num_samples))]
    assert [b.input_tensors["random_seed"].item() for b in bridge.bodies] == [5 + j for j in starts]
    assert [len(e.choice_indices) for e in run.engine_requests] == num_samples


def test_gpt_manager_admission_errors_name_the_openai_field():
    from samples.serve.openai_protocol import engine_field_to_openai
    from samples.serve.params import name_body_field
    for error in (VALIDATION_ERROR_PREFIX + ": num_return_sequences: 17 sequences exceed max_batch_size 16",
                  VALIDATION_ERROR_PREFIX + ": request 3: num_return_sequences: 17 sequences exceed max_batch_size 16"):
        assert engine_field_to_openai(name_body_field(error), False) == (
            "n", "n: 17 sequences exceed max_batch_size 16")
    field, message = engine_field_to_openai(name_body_field(
        VALIDATION_ERROR_PREFIX + ": guided_decoding_params: 64 grammars are being compiled already"), True)
    assert field == "tools" and message.startswith("tools: 64 grammars")
