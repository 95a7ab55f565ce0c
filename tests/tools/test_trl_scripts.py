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


def _frame(filename: str, line: int, name: str) -> dict:
    return {"filename": filename, "line": line, "name": name}


def test_peak_allocations_says_what_is_live_at_the_peak_by_origin(common):
    ours = [_frame("/x/torch/nn/functional.py", 10, "linear"), _frame("/x/site-packages/polykernel/backends/_linear_logps.py", 5, "walk")]
    other = [_frame("/x/site-packages/transformers/models/llama/modeling_llama.py", 7, "forward")]
    engine = [_frame("", 0, "c10::cuda::CUDACachingAllocator::malloc"), _frame("", 0, "torch::autograd::Engine::thread_main")]
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": other},
        {"action": "alloc", "addr": 2, "size": 300, "frames": ours},
        {"action": "alloc", "addr": 3, "size": 300, "frames": ours},
        {"action": "alloc", "addr": 5, "size": 50, "frames": engine},  # the peak: 750
        {"action": "free_requested", "addr": 2, "size": 300},
        {"action": "free_completed", "addr": 2, "size": 300},
        {"action": "alloc", "addr": 4, "size": 250, "frames": other},  # 700: below the peak
        {"action": "free_completed", "addr": 99, "size": 5},  # allocated before the recording began
        {"action": "segment_alloc", "addr": 0, "size": 4096},
    ]
    peak, alive = common.peak_allocations(trace)
    assert peak == 750 and [e["addr"] for e in alive] == [2, 3, 1, 5]  # largest first; block 4 came after the peak
    sites = common.by_site(alive)
    assert sites[0] == {"site": "/x/site-packages/polykernel/backends/_linear_logps.py:5 walk", "bytes": 600, "blocks": 2}
    assert sites[1]["bytes"] == 100 and sites[1]["site"].endswith("modeling_llama.py:7 forward")
    assert sites[2]["site"] == "torch::autograd::Engine::thread_main"  # the backward's thread: C++ frames only
    assert common.peak_allocations([]) == (0, [])


def test_without_a_gpu_the_memory_trace_records_nothing(common, monkeypatch):
    def no_cuda(*a, **k):
        raise AssertionError("a CUDA call without cuda")

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", no_cuda)
    with common.memory_trace(False) as at_peak:
        pass
    assert at_peak == {}


def test_with_a_gpu_the_memory_trace_summarizes_and_stops_recording(common, monkeypatch):
    calls = []
    trace = [{"action": "alloc", "addr": 1, "size": 64, "frames": [_frame("/x/site-packages/trl/trainer/grpo.py", 3, "step")]}]
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *a, **k: calls.append(k.get("enabled", "all")))
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda *a, **k: {"device_traces": [trace]})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    with common.memory_trace(True) as at_peak:
        assert calls == ["all"] and at_peak == {}
    assert calls == ["all", None]  # recording stopped
    assert at_peak["peak_bytes"] == 64 and at_peak["allocations"] == 1
    assert at_peak["by_site"] == [{"site": "/x/site-packages/trl/trainer/grpo.py:3 step", "bytes": 64, "blocks": 1}]
    with pytest.raises(RuntimeError), common.memory_trace(True):  # stopped on an error too
        raise RuntimeError("a step failed")
    assert calls[-1] is None


def test_the_largest_site_at_the_peak_is_printed(common):
    record = {"at_peak": {"by_site": [{"site": "a.py:1 f", "bytes": 3 << 20, "blocks": 2}, {"site": "b.py:2 g", "bytes": 1, "blocks": 1}]}}
    assert common.at_peak_text(record) == "  largest at peak: 3 MiB in 2 from a.py:1 f"
    assert common.at_peak_text({}) == "" and common.at_peak_text({"at_peak": {"by_site": []}}) == ""
