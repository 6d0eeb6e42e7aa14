"""GptManager over tensor x pipeline parallelism: 4 spawned ranks as 2 stages of 2 tensor-parallel
ranks, against one process on the same engine (identical greedy, beam and seeded-sampling tokens,
log probs within 1e-4); rank 0 keeps one micro-batch per stage in flight, each with half the
active requests, and a request is never in two of them at once."""
from __future__ import annotations

import os

import orjson
import pytest
import torch

from batch_manager import GptManager, SchedulerPolicy, TrtGptModelOptionalParams, TrtGptModelType
from runtime import WorldConfig, build_engine
from tests.batch_manager.conftest import Client
from tests.batch_manager.test_tensor_parallel import MIXED, PROMPTS, TOLERANCE, _request
from tests.distributed import RankPool
from tests.factories import make_checkpoint

TIMEOUT_S = 10

# Eight requests at once: greedy, beams, seeded sampling, streaming (see test_tensor_parallel).
SPECS = MIXED + [dict(id=8 + i, prompt=PROMPTS[i], new=9) for i in range(4)]


@pytest.fixture(scope="module")
def pool():
    ranks = RankPool(4, env={"BATCH_MANAGER_DIST_TIMEOUT_S": str(TIMEOUT_S)})
    yield ranks
    ranks.close()


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("pp_manager")
    make_checkpoint(root / "hf", "llama", seed=5)   # 4 heads, 2 KV heads, 2 layers: one per stage
    build_engine(root / "hf", root / "engine", tokens_per_block=4, max_batch_size=12, max_input_len=48,
                 max_seq_len=96, max_num_tokens=256, gather_generation_logits=True)
    return str(root / "engine")


def serve(engine_dir: str, world: WorldConfig | None) -> tuple[dict, list[dict]] | None:
    """All of SPECS at once; rank 0 (or one process) returns ({id: (output ids, log probs, error)},
    the iteration stats), the other ranks None."""
    optional = TrtGptModelOptionalParams(world_config=world)
    if int(os.environ.get("RANK", "0")) != 0 and world is not None:
        manager = GptManager(engine_dir, TrtGptModelType.InflightFusedBatching, 2,
                             SchedulerPolicy.GUARANTEED_NO_EVICT, None, None, optional_params=optional)
        manager.shutdown()
        assert manager.fatal_error is None, manager.fatal_error
        return None
    client = Client([_request(s) for s in SPECS])
    with GptManager(engine_dir, TrtGptModelType.InflightFusedBatching, 2, SchedulerPolicy.GUARANTEED_NO_EVICT,
                    *client.callbacks(), optional_params=optional):
        client.wait(120)
    out = {}
    for s in SPECS:
        tensors, _, error = client.final(s["id"])
        out[s["id"]] = (tensors["output_ids"], tensors.get("log_probs"), error)
    return out, [orjson.loads(line) for line in client.stats]


def test_two_stages_of_two_tensor_parallel_ranks_serve_what_one_process_serves(pool, engine_dir):
    expected, _ = serve(engine_dir, None)
    results = pool.run(serve, engine_dir, WorldConfig(tensor_parallelism=2, pipeline_parallelism=2))
    assert results[1:] == [None, None, None]
    got, stats = results[0]
    for request_id, (ids, log_probs, error) in expected.items():
        assert not error and not got[request_id][2]
        assert torch.equal(got[request_id][0], ids), f"request {request_id}"
        torch.testing.assert_close(got[request_id][1], log_probs, atol=TOLERANCE, rtol=0)
    # Two micro-batches alternate: while all 12 requests are active, each step schedules at most
    # half of them (a beam-2 request counts as 2 sequences), and the ids 0 and 1 alternate.
    busy = [s for s in stats if s["Active Request Count"] == len(SPECS)]
    assert busy and all(s["Scheduled Requests"] <= len(SPECS) // 2 for s in busy)
    assert {s["MicroBatch ID"] for s in stats} == {0, 1}
