"""samples.serve.openai_choices over a scripted bridge (no engine): responses queued after a stop
string ended their choice are dropped, errors map to their statuses, close() cancels exactly the
unfinished choices, a refused submit leaves nothing running."""
from __future__ import annotations

import asyncio

import pytest

from batch_manager.executor import QueueFullError
from samples.serve.bridge import SHUTTING_DOWN, VALIDATION_ERROR_PREFIX, ResponseEvent
from samples.serve.openai_choices import ChoiceRun
from samples.serve.openai_protocol import ModelInfo, OpenAIError, parse_request
from tests.samples.scripted_model import VOCAB_SIZE, write_tokenizer


@pytest.fixture(scope="module")
def info(tmp_path_factory):
    import transformers
    directory = str(tmp_path_factory.mktemp("bpe"))
    write_tokenizer(directory)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
    return ModelInfo("m", tokenizer, VOCAB_SIZE, 64, tokenizer.eos_token_id)


class ScriptedBridge:
    """submit() hands out ids and queues; the test puts the responses; cancel() is recorded."""

    def __init__(self, refuse_after: int | None = None, refusal: Exception | None = None):
        self.queues: dict[int, asyncio.Queue] = {}
        self.bodies: list = []
        self.cancelled: list[int] = []
        self.refuse_after, self.refusal = refuse_after, refusal
        self.metrics = None

    def submit(self, make_request, return_log_probs, loop):
        if self.refuse_after is not None and len(self.queues) >= self.refuse_after:
            raise self.refusal
        request_id = len(self.queues) + 1
        self.bodies.append(make_request(request_id))
        self.queues[request_id] = asyncio.Queue()
        return request_id, self.queues[request_id]

    def cancel(self, request_id: int) -> None:
        self.cancelled.append(request_id)


def ids(info, text: str) -> list[int]:
    return info.tokenizer.encode(text, add_special_tokens=False)


def spec(info, **fields):
    return parse_request({"model": "m", "prompt": "Say:", "max_tokens": 20, **fields}, False, info)


def test_responses_after_a_stop_string_are_dropped(info):
    async def scenario():
        bridge = ScriptedBridge()
        run = ChoiceRun(bridge, spec(info, n=2, stop="lo", seed=5), info, None)
        run.submit()
        tokens = ids(info, "Hello world")
        for t in tokens:   # choice 0 streams past its stop string before anyone reads
            bridge.queues[1].put_nowait(ResponseEvent([t], False))
        bridge.queues[2].put_nowait(ResponseEvent(ids(info, "Hi"), True))
        updates = []
        while not run.is_done:
            updates.append(await run.next_update())
        run.close()
        return bridge, run, updates

    bridge, run, updates = asyncio.run(scenario())
    assert ["".join(c.text) for c in run.choices] == ["Hel", "Hi"]
    assert [c.finish_reason for c in run.choices] == ["stop", "stop"]
    assert run.choices[0].num_tokens == len(ids(info, "Hello"))   # up to the token completing "lo"
    assert bridge.cancelled == [1]   # the stopped choice; choice 1 had finished itself
    assert [body.input_tensors["random_seed"].item() for body in bridge.bodies] == [5, 6]   # seed + j


@pytest.mark.parametrize("error, status", [
    (VALIDATION_ERROR_PREFIX + ": request 1: request_output_len: 0 must be positive", 400),
    (SHUTTING_DOWN, 503),
    ("model step failed: out of memory", 500),
])
def test_error_responses_map_to_statuses(info, error, status):
    async def scenario():
        bridge = ScriptedBridge()
        run = ChoiceRun(bridge, spec(info, n=3), info, None)
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
        run = ChoiceRun(bridge, spec(info, n=4), info, None)
        with pytest.raises(OpenAIError) as e:
            run.submit()
        return bridge, e.value

    bridge, e = asyncio.run(scenario())
    assert e.status == status and sorted(bridge.cancelled) == [1, 2]
