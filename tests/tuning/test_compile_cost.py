"""Measured selection charges a per-process compile (torch_compile): a one-off call never picks it."""

from __future__ import annotations

import math

import pytest
import torch

import polykernel
from _tuning_helpers import isolate_tuning, only, plant, use_fake_clock
from polykernel import tuning
from polykernel.tuning.measure import Timing, choose, slowest


@pytest.fixture(autouse=True)
def _tuning_env(tmp_path, monkeypatch):
    use_fake_clock(monkeypatch)  # planted delays are exact
    isolate_tuning(tmp_path, monkeypatch)
    monkeypatch.setenv("POLYKERNEL_TUNE", "on")
    yield
    polykernel.clear_caches()


def _tuned(n=8):
    x, w = torch.randn(4, n), torch.ones(n)
    polykernel.rms_norm(x, w)
    d = polykernel.decisions("rms_norm")[-1]
    return d["impl"], polykernel.explain("rms_norm", x, w).tuned


def test_compile_time_is_measured_and_a_one_off_call_never_picks_it(monkeypatch):
    # torch_compile runs 4x faster once compiled, but its first call compiles for 2 s.
    plant("torch_compile", 1, delay=0.001, first_delay=2.0)
    plant("cute_dsl", 0, delay=0.004)
    only("torch_compile", "cute_dsl")
    monkeypatch.setenv("POLYKERNEL_TUNE_CALLS", "1")
    impl, tuned = _tuned()
    assert impl == "cute_dsl"
    assert tuned["times"]["torch_compile"]["compile_ms"] == pytest.approx(2000.0)
    assert tuned["calls"] == 1
    assert "compile_ms" not in tuned["times"]["cute_dsl"]  # only per-process compilers are charged


@pytest.mark.parametrize(("calls", "winner"), [("1e6", "torch_compile"), ("100", "cute_dsl")])
def test_a_long_running_process_amortises_the_compile(monkeypatch, calls, winner):
    # 2 s over 1e6 calls is 2 µs a call (it wins); over 100 calls, 20 ms a call (it loses).
    plant("torch_compile", 1, delay=0.001, first_delay=2.0)
    plant("cute_dsl", 0, delay=0.004)
    only("torch_compile", "cute_dsl")
    monkeypatch.setenv("POLYKERNEL_TUNE_CALLS", calls)
    assert _tuned()[0] == winner


def test_a_compile_paid_before_the_measurement_still_counts(monkeypatch):
    # Compiled earlier in this process (for another key): its first call here is fast, but a
    # fresh process that meets only this key pays the compile the impl reports.
    plant("torch_compile", 1, delay=0.001, reports_ms=2000.0)
    plant("cute_dsl", 0, delay=0.004)
    only("torch_compile", "cute_dsl")
    monkeypatch.setenv("POLYKERNEL_TUNE_CALLS", "1")
    impl, tuned = _tuned()
    assert impl == "cute_dsl" and tuned["times"]["torch_compile"]["compile_ms"] == pytest.approx(2000.0)


def test_other_backends_first_calls_are_not_charged(monkeypatch):
    plant("cuda_jit", 1, delay=0.001, first_delay=2.0)  # a build cached on disk: not per process
    plant("cute_dsl", 0, delay=0.004)
    only("cuda_jit", "cute_dsl")
    monkeypatch.setenv("POLYKERNEL_TUNE_CALLS", "1")
    impl, tuned = _tuned()
    assert impl == "cuda_jit" and "compile_ms" not in tuned["times"]["cuda_jit"]


def test_cost_model_and_json_round_trip():
    t = Timing(gpu_ms=0.5, host_ms=0.1, compile_ms=1000.0)
    assert t.cost(graph=True) == 0.5  # no horizon: steady time only
    assert t.cost(graph=True, calls=1000) == pytest.approx(1.5)
    assert t.cost(graph=False, calls=1) == pytest.approx(1000.5)
    assert Timing.from_json(t.as_json()) == t
    assert Timing.from_json(Timing(0.5, 0.1).as_json()).compile_ms is None
    times = {"triton": Timing(0.6, 0.1), "torch_compile": t}
    assert choose(times, ["triton", "torch_compile"], ["triton", "torch_compile"], 0.03, calls=1)["eager"] == "triton"
    assert choose(times, ["triton", "torch_compile"], ["triton", "torch_compile"], 0.03, calls=1e6)["graph"] == "torch_compile"
    worst = slowest([{"torch_compile": t}, {"torch_compile": Timing(0.4, 0.1, compile_ms=3000.0)}])
    assert worst["torch_compile"] == Timing(0.5, 0.1, compile_ms=3000.0)


@pytest.mark.parametrize("value", ["0", "-5", "abc", "nan", "0.5"])
def test_bad_calls_is_an_error_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("POLYKERNEL_TUNE_CALLS", value)
    with pytest.raises(ValueError, match="POLYKERNEL_TUNE_CALLS"):
        tuning.calls()


def test_calls_default(monkeypatch):
    monkeypatch.delenv("POLYKERNEL_TUNE_CALLS", raising=False)
    assert tuning.calls() == tuning.DEFAULT_CALLS and math.isfinite(tuning.calls())
