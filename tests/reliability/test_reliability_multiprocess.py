"""Reliability: 4 processes (gloo ranks) tune overlapping keys into one store at once, measuring
on the CPU with Triton's interpreter as the second impl; the store ends valid with every key, and
after ``sync_decisions`` every rank runs the same impl. (tests/test_tuning_store.py covers plain
concurrent writers; tests/test_tuning_dist.py two ranks with prepared stores.)"""

from __future__ import annotations

import json

import pytest

WORLD = 4


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_four_ranks_tune_overlapping_keys_into_one_store_and_agree(tmp_path):
    import torch.multiprocessing as mp

    from _tuning_helpers import tune_and_sync_worker

    cache, out = tmp_path / "cache", tmp_path / "out"
    out.mkdir()
    mp.start_processes(tune_and_sync_worker, args=(WORLD, str(tmp_path / "init"), str(cache), str(out)), nprocs=WORLD, start_method="spawn")
    (store,) = cache.glob("tuning-*.json")  # one environment, one file
    data = json.loads(store.read_text())
    ns = sorted(json.loads(k)["class"]["n"] for k in data["entries"])
    assert ns == sorted([32, 48] + [16 * (r + 4) for r in range(WORLD)])  # every key, once
    for entry in data["entries"].values():
        # torch_compile runs on the CPU too; its measured time carries its compile (never the winner here)
        assert entry["eager"] in ("torch", "triton") and set(entry["times"]) - {"torch_compile"} == {"torch", "triton"}
    ran = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert len({r["impl"] for r in ran}) == 1  # the same choice everywhere
    assert {r["source"] for r in ran} <= {"tuned", "auto"}
