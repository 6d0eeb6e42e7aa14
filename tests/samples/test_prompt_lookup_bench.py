"""samples.microbench.prompt_lookup on the tiny engine: prompt lookup leaves greedy outputs
unchanged and reports the stats' draft counters."""
from __future__ import annotations

import random

from samples.microbench.prompt_lookup import serve


def test_prompt_lookup_on_and_off_give_the_same_tokens(tiny_model_dirs):
    engine_dir = str(tiny_model_dirs[1])
    rng = random.Random(0)
    span = [rng.randrange(3, 128) for _ in range(6)]
    prompts = [span * 4 + [rng.randrange(3, 128)] for _ in range(4)]   # something to look up
    off = serve(engine_dir, prompts, 12, 0, 4)
    on = serve(engine_dir, prompts, 12, 3, 4)
    assert on["outputs"] == off["outputs"]
    assert off["proposed"] == 0 and on["proposed"] > 0
    assert 0 <= on["accepted"] <= on["proposed"]
    assert all(len(t) == len(p) + 12 for t, p in zip(on["outputs"].values(), prompts))
    assert round(off["tokens_per_s"] * off["seconds"]) == 4 * 12     # generated tokens, not the prompts
