"""samples.dynamo's engine driven directly, without Dynamo's services (a `dynamo._core.Context` per
request, on the tiny model): greedy tokens equal the Executor's own; EOS, max_tokens and stop ids
end the request with Dynamo's finish reasons and usage; a stopped context or `abort` ends it with a
cancelled chunk and its blocks freed; n sequences; bad or unsupported options are InvalidArgument
naming the field; the load snapshot and the trtllm_ metrics follow the requests."""
from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("dynamo.common.backend", reason="ai-dynamo is not installed (README: Dynamo section)")

from dynamo._core import Context  # noqa: E402
from dynamo.llm.exceptions import InvalidArgument  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from prometheus_client import generate_latest  # noqa: E402

from batch_manager.executor import Executor, ExecutorConfig, KvCacheConfig, OutputConfig, Request  # noqa: E402
from samples.dynamo.engine import ExecutorEngine  # noqa: E402
from samples.dynamo.worker_args import parse_worker_args  # noqa: E402

PROMPT = [5, 9, 17, 33, 4, 70, 12, 8, 90, 3]


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def engine(tiny_model_dirs, tokenizer_dir, tmp_path_factory, loop):
    _, engine_dir, _ = tiny_model_dirs
    options, _ = parse_worker_args(["--engine-dir", engine_dir, "--tokenizer-dir", tokenizer_dir, "--card-dir",
                                    str(tmp_path_factory.mktemp("card") / "tiny"), "--disable-kv-routing"])
    engine = ExecutorEngine(options)
    loop.run_until_complete(engine.start(0))
    yield engine
    loop.run_until_complete(engine.cleanup())
    loop.run_until_complete(engine.cleanup())   # idempotent


def collect(loop, engine, request: dict, stop_after: int | None = None, abort_after: int | None = None) -> list[dict]:
    async def run() -> list[dict]:
        context, chunks = Context(), []
        async for chunk in engine.generate(request, context):
            chunks.append(chunk)
            if len(chunks) == stop_after:
                context.stop_generating()
            if len(chunks) == abort_after:
                await engine.abort(context)
        return chunks
    return loop.run_until_complete(asyncio.wait_for(run(), 120))


def tokens(chunks: list[dict], index: int = 0) -> list[int]:
    return [t for c in chunks if c["index"] == index for t in c["token_ids"]]


def executor_greedy(engine_dir: str, prompt: list[int], max_tokens: int) -> list[int]:
    with Executor(engine_dir, executor_config=ExecutorConfig(kv_cache_config=KvCacheConfig(enable_block_reuse=True))) \
            as executor:
        request_id = executor.enqueue_request(Request(prompt, max_tokens, output_config=OutputConfig(
            exclude_input_from_output=True)))
        [response] = executor.await_responses(request_id, timeout=120)
        return response.result.output_token_ids[0]


def greedy(max_tokens: int, **stop) -> dict:
    return {"token_ids": PROMPT, "sampling_options": {"temperature": 0.0},
            "stop_conditions": {"max_tokens": max_tokens, "ignore_eos": True, **stop}}


def test_registration_is_the_engines(engine):
    stream = engine.stream
    assert engine.limits.max_seq_len == 96 and stream.limits.tokens_per_block == 4
    assert engine.options.card_dir.endswith("tiny")


def test_greedy_tokens_equal_the_executors_and_stream_one_chunk_each(engine, loop, tiny_model_dirs):
    chunks = collect(loop, engine, greedy(12))
    expected = executor_greedy(tiny_model_dirs[1], PROMPT, 12)
    assert tokens(chunks) == expected and len(expected) == 12
    assert all(len(c["token_ids"]) == 1 for c in chunks)
    assert [c.get("finish_reason") for c in chunks] == [None] * 11 + ["length"]
    assert chunks[-1]["completion_usage"] == {"prompt_tokens": 10, "completion_tokens": 12, "total_tokens": 22}


def test_eos_max_tokens_and_stop_ids_end_the_request(engine, loop):
    reference = tokens(collect(loop, engine, greedy(12)))
    eos = reference[4]
    first = reference.index(eos)
    ended = collect(loop, engine, {"token_ids": PROMPT, "sampling_options": {"temperature": 0.0},
                                   "stop_conditions": {"max_tokens": 12, "stop_token_ids_hidden": [eos]}})
    assert ended[-1]["finish_reason"] == "stop"
    assert tokens(ended) == reference[:first]   # the end id itself is not output
    assert ended[-1]["completion_usage"]["completion_tokens"] == first
    stopped = collect(loop, engine, greedy(12, stop_token_ids=[reference[2]]))
    cut = reference.index(reference[2])
    assert stopped[-1]["finish_reason"] == "stop" and tokens(stopped) == reference[:cut + 1]
    short = collect(loop, engine, greedy(3))
    assert tokens(short) == reference[:3] and short[-1]["finish_reason"] == "length"


def test_no_max_tokens_generates_up_to_max_seq_len(engine, loop):
    chunks = collect(loop, engine, {"token_ids": PROMPT, "sampling_options": {"temperature": 0.0},
                                    "stop_conditions": {"ignore_eos": True}})
    assert len(tokens(chunks)) == 96 - len(PROMPT) and chunks[-1]["finish_reason"] == "length"


@pytest.mark.parametrize("how", ["stop_generating", "abort"])
def test_a_stopped_request_ends_cancelled_with_its_blocks_freed(engine, loop, how):
    kv = engine.stream.executor.kv_cache_manager
    request = greedy(80)
    chunks = collect(loop, engine, request, **({"stop_after": 2} if how == "stop_generating" else {"abort_after": 2}))
    assert chunks[-1]["finish_reason"] == "cancelled"
    assert 2 <= len(tokens(chunks)) < 80
    assert chunks[-1]["completion_usage"]["completion_tokens"] == len(tokens(chunks))
    assert kv.num_used_blocks == 0
    counts = engine.stream.executor.get_bookkeeping_counts()
    assert all(value == 0 for value in counts.values()), counts
    assert engine.stream.num_live() == 0 and not engine._context_to_request


def test_n_sequences_each_end_with_their_finish_reason(engine, loop):
    chunks = collect(loop, engine, {"token_ids": PROMPT, "sampling_options": {"n": 2, "temperature": 1.0, "seed": 3},
                                    "stop_conditions": {"max_tokens": 5, "ignore_eos": True}})
    for index in (0, 1):
        assert len(tokens(chunks, index)) == 5
        assert [c["finish_reason"] for c in chunks if c["index"] == index and "finish_reason" in c] == ["length"]
    assert chunks[-1]["completion_usage"]["completion_tokens"] == 10


def test_log_probs_align_with_the_tokens(engine, loop):
    chunks = collect(loop, engine, {**greedy(4), "output_options": {"logprobs": 2}})
    for chunk in chunks:
        assert len(chunk["log_probs"]) == len(chunk["token_ids"]) == len(chunk["top_logprobs"])
        top = chunk["top_logprobs"][0]
        assert [t["rank"] for t in top] == [1, 2] and top[0]["token_id"] == chunk["token_ids"][0]
        assert top[0]["token"] == f"t{chunk['token_ids'][0]}"


@pytest.mark.parametrize("request_body, field", [
    ({"sampling_options": {"use_beam_search": True}}, "sampling_options.use_beam_search"),
    ({"sampling_options": {"guided_decoding": {"json": {}}}}, "sampling_options.guided_decoding"),
    ({"sampling_options": {"best_of": 3}}, "sampling_options.best_of"),
    ({"sampling_options": {"temperature": -1.0}}, "sampling_options.temperature"),
    ({"sampling_options": {"top_p": 7}}, "sampling_options.top_p"),
    ({"sampling_options": {"n": 0}}, "sampling_options.n"),
    ({"stop_conditions": {"max_tokens": 90}}, "stop_conditions.max_tokens"),
    ({"stop_conditions": {"max_tokens": 0}}, "stop_conditions.max_tokens"),
    ({"stop_conditions": {"min_tokens": -2}}, "stop_conditions.min_tokens"),
    ({"stop_conditions": {"stop_token_ids": ["x"]}}, "stop_conditions.stop_token_ids"),
    ({"stop_conditions": {"max_thinking_tokens": 5}}, "stop_conditions.max_thinking_tokens"),
    ({"output_options": {"prompt_logprobs": 2}}, "output_options.prompt_logprobs"),
    ({"output_options": {"logprobs": 99}}, "output_options.logprobs"),
    ({"token_ids": [1, 500]}, "token_ids"),
    ({"token_ids": []}, "token_ids"),
    ({"sampling_options": "hot"}, "sampling_options"),
])
def test_bad_or_unsupported_options_are_invalid_argument_naming_the_field(engine, loop, request_body, field):
    request = {"token_ids": PROMPT, **request_body}
    with pytest.raises(InvalidArgument) as error:
        collect(loop, engine, request)
    assert str(error.value).startswith(field + ":"), str(error.value)
    assert collect(loop, engine, greedy(2))[-1]["finish_reason"] == "length"   # the worker keeps serving


def test_neutral_values_of_unimplemented_options_are_accepted(engine, loop):
    request = greedy(2)
    request["sampling_options"].update(best_of=1, use_beam_search=False, guided_decoding=None, logit_bias={})
    request["stop_conditions"].update(stop=["never"], min_tokens=1)
    request["output_options"] = {"skip_special_tokens": True, "prompt_logprobs": None}
    assert len(tokens(collect(loop, engine, request))) == 2


def test_metrics_and_load_snapshot_follow_the_requests(engine, loop):
    published = []

    class Publisher:
        def publish(self, rank, snapshot):
            published.append((rank, snapshot))

    engine.attach_snapshot_publisher(Publisher())
    collect(loop, engine, greedy(3))
    # The consumer thread may still be handing over the last iterations' snapshots (each carries
    # its own iteration's block counts): the last one settles at no block used.
    deadline = time.monotonic() + 10
    while published[-1][1].kv_used_blocks and time.monotonic() < deadline:
        time.sleep(0.01)
    rank, snapshot = published[-1]
    total = engine.stream.executor.kv_cache_manager.num_blocks
    assert rank == 0 and snapshot.kv_total_blocks == total and snapshot.kv_used_blocks == 0
    # The request's context and generation iterations held blocks, whenever the consumer saw them.
    assert any(s.kv_used_blocks > 0 for _, s in published[:-1])
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(engine.metrics.registry).decode())}
    assert families["trtllm_time_to_first_token_seconds"].type == "histogram"
    assert families["trtllm_request_success"].type == "counter"
    assert families["trtllm_kv_cache_utilization"].type == "gauge"
    successes = {s.labels["finished_reason"]: s.value for s in families["trtllm_request_success"].samples
                 if s.name.endswith("_total")}
    assert successes["length"] >= 1
    engine._snapshot_publisher = None


@pytest.fixture(scope="module")
def role_engines(tiny_model_dirs, tokenizer_dir, tmp_path_factory, loop):
    """A prefill and a decode engine on the tiny model (Dynamo's roles)."""
    _, engine_dir, _ = tiny_model_dirs
    engines = []
    for role in ("prefill", "decode"):
        options, config = parse_worker_args(["--engine-dir", engine_dir, "--tokenizer-dir", tokenizer_dir, "--card-dir",
                                             str(tmp_path_factory.mktemp(role) / "tiny"), "--disable-kv-routing",
                                             "--disaggregation-mode", role])
        assert config.disaggregation_mode.value == role
        engines.append(ExecutorEngine(options))
        loop.run_until_complete(engines[-1].start(0))
    yield engines
    for engine in engines:
        loop.run_until_complete(engine.cleanup())


def test_prefill_then_decode_equals_one_aggregated_request_with_the_kv_moved(engine, role_engines, loop):
    """The prefill worker's terminal chunk (its first token and the hand-off) given to the decode
    worker as Dynamo's PrefillRouter does: the decode stream leads with that token and the whole
    equals the aggregated greedy tokens; the decode side computed no prompt block itself."""
    prefill, decode = role_engines
    expected = tokens(collect(loop, engine, greedy(10)))
    prefill_chunks = collect(loop, prefill, greedy(1))   # the PrefillRouter asks the prefill worker for 1 token
    [terminal] = prefill_chunks
    assert terminal["token_ids"] == expected[:1] and terminal["finish_reason"] == "length"
    assert set(terminal["disaggregated_params"]) == {"context_phase_params"}
    decoded = collect(loop, decode, {**greedy(10), "prefill_result": {
        "disaggregated_params": terminal["disaggregated_params"]}})
    assert tokens(decoded) == expected
    assert decoded[0]["token_ids"] == expected[:1]
    assert decoded[-1]["finish_reason"] == "length" and decoded[-1]["completion_usage"]["completion_tokens"] == 10
    deadline = time.monotonic() + 30   # fetched, so released (on the prefill engine's worker thread)
    while prefill.stream.executor.get_bookkeeping_counts()["kv_exports"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert prefill.stream.executor.get_bookkeeping_counts()["kv_exports"] == 0


def test_a_request_the_prefill_ended_or_a_max_tokens_of_1_ends_on_the_decode_worker_without_generating(
        engine, role_engines, loop):
    prefill, decode = role_engines
    expected = tokens(collect(loop, engine, greedy(10)))
    [terminal] = collect(loop, prefill, greedy(1, stop_token_ids_hidden=[expected[0]], ignore_eos=False))
    assert terminal["disaggregated_params"] == {"finish_reason": "stop", "first_gen_tokens": []}
    [ended] = collect(loop, decode, {**greedy(10), "prefill_result": {"disaggregated_params": terminal[
        "disaggregated_params"]}})
    assert ended["token_ids"] == [] and ended["finish_reason"] == "stop"
    [terminal] = collect(loop, prefill, greedy(1))
    [one] = collect(loop, decode, {**greedy(1), "prefill_result": {"disaggregated_params": terminal[
        "disaggregated_params"]}})
    assert one["token_ids"] == expected[:1] and one["finish_reason"] == "length"


@pytest.mark.parametrize("prefill_result, problem", [
    (None, "missing"), ({"disaggregated_params": {}}, "missing"),
    ({"disaggregated_params": {"context_phase_params": "@@@"}}, "not base64"),
    ({"disaggregated_params": {"context_phase_params": "AAAA"}}, "not the bytes of a ContextPhaseParams")])
def test_a_decode_request_without_a_good_hand_off_is_invalid_argument(role_engines, loop, prefill_result, problem):
    _, decode = role_engines
    request = {**greedy(4), **({"prefill_result": prefill_result} if prefill_result is not None else {})}
    field = "(prefill_result.disaggregated_params.)?context_phase_params"
    with pytest.raises(InvalidArgument, match=f"{field}: .*{problem}"):
        collect(loop, decode, request)
