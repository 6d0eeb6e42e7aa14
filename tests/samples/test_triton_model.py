"""samples.triton's `tensorrt_llm` model in the test process, through a stand-in for the backend's
utils (tests/samples/fake_triton.py), on a tiny engine with two slots: stops and cancellations of
requests that are still waiting for a slot, the drain, and request ids that are not plain numbers.
Each request must get exactly one final response. (The real server: test_triton*.py.)"""
from __future__ import annotations

import pathlib

import numpy as np
import pytest

from runtime import build_engine
from tests.factories import make_checkpoint
from tests.samples.fake_triton import llm_request, pb_utils, wait_for

LONG = 400   # tokens asked for by requests that are meant to be stopped
PROMPT = [5, 9, 13, 17]


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("triton-model-engine")
    make_checkpoint(root / "hf", "llama", max_position_embeddings=512)
    build_engine(root / "hf", root / "engine", tokens_per_block=4, max_batch_size=2, max_input_len=16,
                 max_seq_len=512, max_num_tokens=64)
    return str(root / "engine")


@pytest.fixture
def make_model(engine_dir, tmp_path):
    from samples.triton.llm_model import LlmModel
    from samples.triton.model_configs import LLM_OUTPUTS
    models = []

    def make(**more_parameters):
        parameters = {"gpt_model_path": engine_dir, "cancellation_check_period_ms": "5",
                      "exclude_input_in_output": "true", "drain_file": str(tmp_path / "draining"), **more_parameters}
        config = {"parameters": {k: {"string_value": v} for k, v in parameters.items()},
                  "output": [{"name": spec.name} for spec in LLM_OUTPUTS]}
        models.append(LlmModel(pb_utils, config, "tensorrt_llm", "1"))
        return models[-1]
    yield make
    for model in models:
        model.finalize()


def submit(model, *requests):
    model.execute(list(requests))
    return requests


def started(request) -> bool:
    return bool(request.sender.tokens)


def assert_one_final(*requests) -> None:
    for r in requests:
        assert r.sender.num_finals == 1 and r.sender.num_sends_after_final == 0, (r.request_id(), r.sender.responses)


def test_stop_ends_a_request_still_waiting_for_a_slot(make_model):
    model = make_model()
    running = submit(model, *(llm_request(str(i), PROMPT, LONG) for i in range(2)))
    wait_for(lambda: all(started(r) for r in running), what="both slots running")
    (waiting,) = submit(model, llm_request("2", PROMPT, LONG))
    (stop,) = submit(model, llm_request("2", [0], 1, stop=True))
    waiting.sender.wait(10)
    assert waiting.sender.tokens == [] and waiting.sender.error is None   # ended before it started
    for r in running:
        submit(model, llm_request(r.request_id(), [0], 1, stop=True))
        assert len(r.sender.wait().tokens) < LONG
    assert_one_final(waiting, stop, *running)


def test_stop_right_after_submit_is_never_lost(make_model):
    model = make_model()
    requests = []
    for i in range(20):
        (r,) = submit(model, llm_request(str(100 + i), PROMPT, LONG, streaming=i % 2 == 0))
        submit(model, llm_request(str(100 + i), [0], 1, stop=True))
        requests.append(r)
    for r in requests:
        assert len(r.sender.wait(30).tokens) < LONG / 2, r.request_id()
    assert_one_final(*requests)


def test_a_cancelled_request_waiting_for_a_slot_ends_without_starting(make_model):
    model = make_model()
    running = submit(model, *(llm_request(str(i), PROMPT, LONG) for i in range(2)))
    wait_for(lambda: all(started(r) for r in running), what="both slots running")
    (waiting,) = submit(model, llm_request("7", PROMPT, LONG))
    waiting.is_cancelled_flag = True
    assert waiting.sender.wait(10).tokens == []
    for r in running:
        r.is_cancelled_flag = True
        assert len(r.sender.wait().tokens) < LONG
    assert_one_final(waiting, *running)


def test_the_drain_answers_every_request_once_and_starts_none(make_model, tmp_path):
    model = make_model()
    requests = submit(model, *(llm_request(str(i), PROMPT, LONG, streaming=i < 2 or i % 2 == 0) for i in range(8)))
    wait_for(lambda: sum(started(r) for r in requests) == 2, what="two slots running")
    (tmp_path / "draining").touch()
    for r in requests:
        r.sender.wait(30)
    running = [r for r in requests if started(r)]
    assert len(running) == 2                                   # nothing started after the drain began
    for r in running:
        assert r.sender.error is None and len(r.sender.tokens) < LONG
    for r in requests:
        if r not in running:
            assert "shutting down: the request was not started" in r.sender.error
            assert r.sender.error.startswith(f"[request id: {r.request_id()}]")
    (late,) = submit(model, llm_request("99", PROMPT, 4))
    assert "shutting down" in late.sender.wait(5).error
    assert_one_final(*requests, late)


@pytest.mark.parametrize("exclude_input", ["true", "false"])
def test_the_drain_answers_a_request_waiting_inside_the_gpt_manager_with_the_shutdown_error(make_model, tmp_path,
                                                                                          exclude_input):
    # a KV pool for one long request: the second is handed over (a free slot) and waits for blocks
    model = make_model(max_tokens_in_paged_kv_cache=str(LONG + 40), exclude_input_in_output=exclude_input)
    first, second = submit(model, llm_request("1", PROMPT, LONG), llm_request("2", PROMPT, LONG, streaming=False))
    wait_for(lambda: started(first), what="the first request running")
    wait_for(lambda: not model._book.has_waiting, what="both handed over")
    (tmp_path / "draining").touch()
    assert first.sender.wait().error is None and 0 < len(first.sender.tokens) < LONG
    assert "shutting down: the request was not started" in second.sender.wait().error
    assert_one_final(first, second)


@pytest.mark.parametrize("triton_id", ["²", "9" * 5000, "007", "a]b", "-3", "1" * 19, "18446744073709551616", ""])
def test_any_request_id_gets_its_answer_carrying_it(make_model, triton_id):
    model = make_model()
    (r,) = submit(model, llm_request(triton_id, PROMPT, 3, streaming=False))
    assert r.sender.wait(30).error is None and len(r.sender.tokens) == 3
    (bad,) = submit(model, llm_request(triton_id, PROMPT, 0))   # an error names the id
    assert bad.sender.wait(30).error.startswith(f"[request id: {triton_id or '<id_unknown>'}] ")
    (long,) = submit(model, llm_request(triton_id, PROMPT, LONG))
    wait_for(lambda: started(long), what="the long request started")
    if triton_id:   # a stop with the same id finds it
        submit(model, llm_request(triton_id, [0], 1, stop=True))
    else:
        long.is_cancelled_flag = True
    assert len(long.sender.wait(30).tokens) < LONG
    assert_one_final(r, bad, long)


def test_plain_decimal_ids_are_the_gpt_manager_ids_and_others_are_mapped():
    from samples.triton.llm_requests import FIRST_MAPPED_ID, RequestIds, spelled_id
    assert [spelled_id(s) for s in ("0", "7", "4611686018427387903")] == [0, 7, FIRST_MAPPED_ID - 1]
    assert [spelled_id(s) for s in ("²", "007", "", "-1", "4611686018427387904", "9" * 5000, "٣")] == [None] * 7
    ids = RequestIds()
    assert ids.assign("²") == FIRST_MAPPED_ID and ids.lookup("²") == FIRST_MAPPED_ID
    assert ids.assign("007") == FIRST_MAPPED_ID + 1 and ids.assign("7") == 7


# --- the ensemble's preprocessing ------------------------------------------------------------------

@pytest.fixture(scope="module")
def preprocessing(tiny_model_dirs, tokenizer_dir, tmp_path_factory):
    """Preprocessing over a copy of the tiny engine (max_seq_len 96) holding the word-level tokenizer."""
    import shutil
    from samples.triton.text_models import Preprocessing
    directory = tmp_path_factory.mktemp("text-engine") / "engine"
    shutil.copytree(tiny_model_dirs[1], directory)
    for path in pathlib.Path(tokenizer_dir).iterdir():
        shutil.copy(path, directory / path.name)
    config = {"parameters": {"tokenizer_dir": {"string_value": str(directory)}}}
    return Preprocessing(pb_utils, config, "preprocessing", "1")


def text_request(query: str | bytes, **arrays):
    from tests.samples.fake_triton import Request
    text = query if isinstance(query, bytes) else query.encode()
    return Request("5", {"QUERY": np.array([[text]], dtype=np.object_),
                         "REQUEST_OUTPUT_LEN": np.array([[4]], np.int32), **arrays})


def test_preprocessing_refuses_text_past_the_limit_before_tokenizing(preprocessing, monkeypatch):
    from samples.serve.openai_basics import MAX_CHARS_PER_TOKEN
    limit = 96 * MAX_CHARS_PER_TOKEN
    (ok,) = preprocessing.execute([text_request("t5 t6 t7")])
    assert ok.error is None and ok.outputs["INPUT_ID"].tolist() == [[5, 6, 7]]
    calls = []
    monkeypatch.setattr(preprocessing.tokenizer, "encode", lambda *a, **k: calls.append(a) or [5])
    too_long = ("t5 " * limit)[:limit + 1]
    huge = b"t5 " * (4 * limit)
    long_stop = np.array([[too_long.encode()]], dtype=np.object_)
    for request, field in ((text_request(too_long), "text_input (QUERY)"), (text_request(huge), "text_input (QUERY)"),
                           (text_request("t5", STOP_WORDS_DICT=long_stop), "stop_words (STOP_WORDS_DICT)")):
        (response,) = preprocessing.execute([request])
        message = response.error.message()
        assert message.startswith(f"{field}: ") and f"more than this server's limit of {limit}" in message, message
    assert calls == [("t5",)]   # the long texts never reached the tokenizer
    (bad,) = preprocessing.execute([text_request(b"\xff\xfe t5")])
    assert bad.error.message().startswith("text_input (QUERY): not UTF-8 text")


@pytest.mark.parametrize("idle", [False, True])
def test_the_gauges_polled_for_idleness_are_set_after_the_rest(idle):
    """Triton's metrics endpoint may read between two gauges' updates: active requests and used
    blocks are set last (in an update and in mark_idle), so a reader that sees them settle at 0
    sees the free blocks at max."""
    import json
    from samples.triton.stats_metrics import StatsMetrics
    metrics = StatsMetrics(pb_utils, "tensorrt_llm", "1", is_static_batching=False)
    metrics.update(json.dumps({"Active Request Count": 1, "Used KV cache blocks": 3, "Free KV cache blocks": 93,
                               "Max KV cache blocks": 96}))
    free = metrics._key_to_metrics["Free KV cache blocks"][0]
    seen = []
    for key in ("Used KV cache blocks", "Active Request Count"):
        metric = metrics._key_to_metrics[key][0]
        metric.set = lambda value, set_=metric.set: (seen.append(free.value), set_(value))
    if idle:
        metrics.mark_idle()
    else:
        metrics.update(json.dumps({"Active Request Count": 0, "Used KV cache blocks": 0, "Free KV cache blocks": 96,
                                   "Max KV cache blocks": 96}))
    assert seen == [96.0, 96.0]
