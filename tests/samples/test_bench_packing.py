"""The packing benchmark: both packings agree on its cases, and it reports both timings."""
from __future__ import annotations

import json

import torch

from samples.microbench.packing import main, make_cases, pack_with_lists, pack_with_packer


def test_the_packer_equals_the_list_packing_on_the_benchmark_cases():
    for name, case in make_cases().items():
        before, after = pack_with_lists(case), pack_with_packer(case)
        assert before.keys() == after.keys(), name
        assert all(torch.equal(before[k], after[k]) and after[k].dtype == torch.int32 for k in before), name


def test_main_writes_both_timings(tmp_path):
    main(["--repeats", "1", "--number", "2", "--json", str(tmp_path / "out.json")])
    results = json.loads((tmp_path / "out.json").read_text())
    assert sorted(results) == sorted(make_cases())
    assert all(r["lists_us"] > 0 and r["packer_us"] > 0 for r in results.values())
