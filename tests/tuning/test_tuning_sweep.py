"""benchmarks/tuning/sweep_tuning.py --smoke: the H200 sweep's script runs end to end on the CPU."""

from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path

import pytest

import polykernel
from _scripts import load_benchmark

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "tuning" / "sweep_tuning.py"

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


def _load():
    return load_benchmark("sweep_tuning")


def test_smoke_sweep_writes_results_and_the_table(tmp_path, monkeypatch, capsys):
    for name in ("POLYKERNEL_TUNE", "POLYKERNEL_CACHE_DIR", "TRITON_INTERPRET"):
        monkeypatch.setenv(name, "x")  # the script sets them; monkeypatch restores them after
    sweep = _load()
    assert sweep.main(["--out", str(tmp_path), "--smoke", "--ops", "softmax"]) == 0
    polykernel.clear_caches()
    data = json.loads((tmp_path / "sweep_tuning.json").read_text())
    assert data["complete"] is True and data["meta"]["seconds"] >= 0  # written per point, finished at the end
    impls = {r["impl"] for r in data["rows"]}
    assert {"torch", "tuned"} <= impls and "triton" in impls  # every runnable impl, and the tuned call
    assert {(s["op"], s["mode"], s["N"]) for s in data["summary"]} == {("softmax", m, n) for m in ("fwd", "fwd+bwd") for n in (64, 256)}
    for s in data["summary"]:
        assert s["tuned"] in ("torch", "triton") and s["fastest"] in ("torch", "triton") and s["ratio"] > 0
    tuned = [r for r in data["rows"] if r["impl"] == "tuned"]
    assert all(r["ms"] > 0 and r["error"] is None for r in tuned)
    assert list((tmp_path / "cache").glob("tuning-*.json"))  # measured and stored on the first call
    with open(tmp_path / "sweep_tuning.csv") as f:
        assert len(list(csv.DictReader(f))) == len(data["rows"])
    out = capsys.readouterr().out
    assert "tuned/fastest" in out and "points; worst tuned/fastest" in out
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "sweep_tuning.png").stat().st_size > 0


def test_gpu_sizes_keep_x_at_256_mib():
    sweep = _load()
    sizes = sweep._sizes(smoke=False)
    assert [n for _, n in sizes] == [2**k for k in range(10, 19)]
    assert all(m * n * 2 == 2**28 for m, n in sizes)
