"""benchmarks/models/trl_dpo.py and trl_grpo.py record each training step's CUDA peak, so the first
step's (first-call checks, compiles, autotuning) is told apart from the steady steps' (the
twenty-sixth run's GRPO peak was 0.43 GiB above Liger's over the whole run, which mixes the two).
No GPU here: the callback's CUDA calls are stood in for by a fake allocator."""

from __future__ import annotations

import sys

import pytest
import torch

from _scripts import BENCHMARKS, load_benchmark


@pytest.fixture
def common():
    yield load_benchmark("_common")
    sys.modules.pop("_common", None)


class _FakeAllocator:
    """``max_memory_allocated`` as a running maximum that ``reset_peak_memory_stats`` lowers to
    the memory in use; ``use(gib)`` moves the memory in use."""

    def __init__(self) -> None:
        self.now = self.peak = 0

    def use(self, gib: float) -> None:
        self.now = int(gib * 2**30)
        self.peak = max(self.peak, self.now)

    def max_memory_allocated(self) -> int:
        return self.peak

    def reset_peak_memory_stats(self) -> None:
        self.peak = self.now


def test_each_steps_peak_is_its_own_and_the_first_stands_apart(common, monkeypatch):
    fake = _FakeAllocator()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: fake.max_memory_allocated())
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a, **k: fake.reset_peak_memory_stats())
    times: list[float] = []
    peaks: list[float] = []
    timer = common.step_timer(True, times, peaks)
    for high, after in ((14.0, 10.0), (12.0, 10.0), (12.5, 10.0)):  # the first step's check is the highest
        timer.on_step_begin()
        fake.use(high)
        fake.use(after)
        timer.on_step_end()
    assert len(times) == 3 and peaks == [14.0, 12.0, 12.5]
    fields = common.peak_fields(peaks)
    assert fields == {"peak_gib": 14.0, "steady_peak_gib": 12.5, "step_peaks_gib": [14.0, 12.0, 12.5]}
    assert common.peak_text(fields) == "14.00 GiB (later 12.50)"


def test_without_a_gpu_no_peak_is_claimed(common, monkeypatch):
    def no_cuda(*a, **k):
        raise AssertionError("a CUDA call without cuda")

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", no_cuda)
    times: list[float] = []
    peaks: list[float] = []
    timer = common.step_timer(False, times, peaks)
    timer.on_step_begin()
    timer.on_step_end()
    assert len(times) == 1 and peaks == []
    fields = common.peak_fields(peaks)
    assert fields == {"peak_gib": None, "steady_peak_gib": None, "step_peaks_gib": []}
    assert common.peak_text(fields) == "-"
    one = common.peak_fields([3.0])  # one step: no steady steps to show
    assert one["steady_peak_gib"] is None and common.peak_text(one) == "3.00 GiB"


def test_both_trainer_scripts_record_the_steps_peaks():
    for name in ("trl_dpo.py", "trl_grpo.py"):
        text = (BENCHMARKS / "models" / name).read_text()
        assert "step_timer(cuda, step_times, peaks)" in text and "**peak_fields(peaks)" in text, name
