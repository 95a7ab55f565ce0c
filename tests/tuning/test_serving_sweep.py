"""benchmarks/tuning/sweep_serving.py: the H200 decode/prefill sweep's script runs end to end on
the CPU (--smoke), sweeps the sizes issue 25 names, and compares the tuned call with the peers."""

from __future__ import annotations

import csv
import importlib.util
import json

import pytest
import torch

import polykernel
from _scripts import load_benchmark
from polykernel.core import registry

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

SMOKE_OPS = ("fused_add_rms_norm_", "dynamic_quant_fp8")  # in place, and fp8 out; no torch_compile to build


def _load():
    return load_benchmark("sweep_serving")


def test_smoke_sweep_writes_results_and_the_table(tmp_path, monkeypatch, capsys):
    for name in ("POLYKERNEL_TUNE", "POLYKERNEL_CACHE_DIR", "TRITON_INTERPRET"):
        monkeypatch.setenv(name, "x")  # the script sets them; monkeypatch restores them after
    sweep = _load()
    assert sweep.main(["--out", str(tmp_path), "--smoke", "--ops", *SMOKE_OPS]) == 0
    polykernel.clear_caches()
    data = json.loads((tmp_path / "sweep_serving.json").read_text())
    assert data["complete"] is True and data["meta"]["seconds"] >= 0  # written per point, finished at the end
    rows = data["rows"]
    points = {(op, mode, t) for op in SMOKE_OPS for mode in ("graph", "eager") for t in (1, 8)}
    assert {(s["op"], s["mode"], s["tokens"]) for s in data["summary"]} == points
    for op, mode, t in points:  # every point: the runnable impls timed, and the tuned call
        got = {r["impl"]: r for r in rows if (r["op"], r["mode"], r["tokens"]) == (op, mode, t)}
        assert {"torch", "triton", "tuned"} <= set(got)
        assert all(got[i]["us"] > 0 and got[i]["error"] is None for i in ("torch", "triton", "tuned"))
        assert got["tuned"]["chosen"] in ("torch", "triton") and got["tuned"]["tune_s"] >= 0
    # the peers are registered but not runnable here: rows with explain's reason and no time
    peers = [r for r in rows if r["op"] == "fused_add_rms_norm_" and r["impl"] in ("cuda_jit", "flashinfer", "sgl_kernel")]
    assert {r["impl"] for r in peers} == {"cuda_jit", "flashinfer", "sgl_kernel"}
    assert all(r["us"] is None and "CUDA" in r["error"] for r in peers)
    for s in data["summary"]:
        assert s["tuned"] in ("torch", "triton") and s["fastest"] in ("torch", "triton") and s["ratio"] > 0
        assert s["peer"] is None and s["peer_target"] is None
    assert list((tmp_path / "cache").glob("tuning-*.json"))  # measured and stored by the first call
    with open(tmp_path / "sweep_serving.csv") as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    out = capsys.readouterr().out
    assert "fused_add_rms_norm_ graph: tuned within 5% of the fastest at" in out and "no peer ran" in out
    assert "points; worst tuned/fastest" in out
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "sweep_serving.png").stat().st_size > 0


def test_gpu_sweep_covers_decode_and_prefill_at_llama_8b_widths():
    sweep = _load()
    assert sweep.TOKENS == (1, 4, 16, 64, 512, 2048, 8192)
    assert {op: sweep.width(op, smoke=False) for op in ("silu_and_mul", "rms_norm", "rotary_embedding_")} == {
        "silu_and_mul": 2 * 14336,
        "rms_norm": 4096,
        "rotary_embedding_": 4096,
    }
    op = registry.get_op("rotary_embedding_")
    _, q, k, head_size, _ = op.example((2, sweep.width("rotary_embedding_", smoke=False)), torch.bfloat16, "cpu").args
    assert (q.shape[1] // head_size, k.shape[1] // head_size, head_size) == (32, 8, 128)


def _rows(times: dict[str, float], mode: str) -> list[dict]:
    return [
        {"op": "silu_and_mul", "mode": mode, "tokens": 1, "impl": i, "ms": us / 1e3, "us": us, "TB/s": 1.0, "chosen": "triton"}
        for i, us in times.items()
    ]


def test_summary_compares_the_tuned_call_with_the_fastest_peer():
    sweep = _load()
    rows = _rows({"triton": 2.0, "flashinfer": 2.2, "sgl_kernel": 2.1, "tuned": 2.0}, "graph")
    rows += _rows({"triton": 9.0, "flashinfer": 7.5, "sgl_kernel": 6.5, "torch": 30.0, "tuned": 9.0}, "eager")
    by_mode = {s["mode"]: s for s in sweep.summarize(rows)}
    graph, eager = by_mode["graph"], by_mode["eager"]
    assert (graph["peer"], graph["fastest"], graph["within_claim"]) == ("sgl_kernel", "triton", True)
    assert graph["vs_peer"] == pytest.approx(2.0 / 2.1) and graph["peer_target"] is True  # graph: tuned/peer <= 1
    assert (eager["peer"], eager["fastest"], eager["within_claim"]) == ("sgl_kernel", "sgl_kernel", False)
    assert eager["vs_peer"] == pytest.approx(2.5) and eager["peer_target"] is False  # eager: tuned - peer <= 2 µs
