"""The CUDA allocator-trace analysis in benchmarks/models/_common.py (the TRL scripts'
``--memory-trace`` and compile_llama.py's ``--memory``): what is live at a step's peak and who
allocated it. No GPU here: traces are written by hand, torch.cuda's recorder is stood in for."""

from __future__ import annotations

import sys

import pytest
import torch

from _scripts import load_benchmark


@pytest.fixture
def common():
    yield load_benchmark("_common")
    sys.modules.pop("_common", None)


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
    assert at_peak["largest"] == [{"bytes": 64, "stack": ["/x/site-packages/trl/trainer/grpo.py:3 step"]}]
    with pytest.raises(RuntimeError), common.memory_trace(True):  # stopped on an error too
        raise RuntimeError("a step failed")
    assert calls[-1] is None


def test_the_largest_site_at_the_peak_is_printed(common):
    record = {"at_peak": {"by_site": [{"site": "a.py:1 f", "bytes": 3 << 20, "blocks": 2}, {"site": "b.py:2 g", "bytes": 1, "blocks": 1}]}}
    assert common.at_peak_text(record) == "  largest at peak: 3 MiB in 2 from a.py:1 f"
    assert common.at_peak_text({}) == "" and common.at_peak_text({"at_peak": {"by_site": []}}) == ""


_ALLOCATOR = [
    _frame("??", 0, "torch::CapturedTraceback::gather(bool, bool, bool)"),  # the recorder itself (an H100's trace)
    _frame("??", 0, "torch::unwind::unwind()"),
    _frame("??", 0, "c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc"),
    _frame("??", 0, "at::empty(c10::ArrayRef<long>, c10::TensorOptions)"),
]


def test_allocation_site_names_the_maker_past_torch_and_the_allocator(common):
    site = common.allocation_site
    torch_frame = _frame("/x/torch/nn/functional.py", 9, "inner")
    assert site({"frames": [torch_frame, _frame("/m/model.py", 3, "f")]}) == "/m/model.py:3 f"  # torch's own frames skipped
    inductor = _frame("/tmp/torchinductor_u/ab/out.py", 7, "call")
    assert site({"frames": [torch_frame, inductor]}) == "/tmp/torchinductor_u/ab/out.py:7 call"  # Inductor's code is shown
    backward = [*_ALLOCATOR, _frame("??", 0, "(anonymous namespace)::RmsNormFn::backward")]
    assert site({"frames": backward}) == "(anonymous namespace)::RmsNormFn::backward"  # first C++ frame past the allocator
    assert site({"frames": [*backward, _frame("/m/model.py", 3, "f")]}) == "/m/model.py:3 f"  # a Python frame wins
    assert site({"frames": _ALLOCATOR}) == site({"frames": []}) == site({}) == "?"
    # the autograd engine's thread: the node whose backward allocated, past the op it called
    node = [*_ALLOCATOR, _frame("??", 0, "at::native::mm_out_cuda"), _frame("??", 0, "torch::autograd::generated::MmBackward0::apply")]
    assert (
        site({"frames": [*node, _frame("??", 0, "torch::autograd::Engine::thread_main")]})
        == "torch::autograd::generated::MmBackward0::apply"
    )
    # the engine summing a tied weight's two gradients out of place (thirtieth run): named as such,
    # past the recorder's gather_with_cpp frame
    add = [
        _frame("??", 0, "torch::cuda::(anonymous namespace)::gather_with_cpp()"),
        _frame("??", 0, "at::(anonymous namespace)::create_out"),
    ]
    buffer = _frame("??", 0, "torch::autograd::InputBuffer::add(unsigned long, at::Tensor&&)")
    assert site({"frames": [*add, buffer, _frame("??", 0, "torch::autograd::Engine::evaluate_function")]}) == buffer["name"][:160]
    assert site({"frames": add}) == "at::(anonymous namespace)::create_out"


def test_allocation_stack_keeps_the_frames_that_say_something(common):
    frames = [*_ALLOCATOR, _frame("??", 0, "at::native::mm_out_cuda"), _frame("/x/torch/nn/functional.py", 9, "inner")]
    frames += [_frame("??", 0, "std::function<void ()>::operator()"), _frame("/m/model.py", 3, "f")]
    assert common.allocation_stack({"frames": frames}) == [
        "at::native::mm_out_cuda",
        "/x/torch/nn/functional.py:9 inner",
        "/m/model.py:3 f",
    ]
    assert common.allocation_stack({"frames": frames}, depth=1) == ["at::native::mm_out_cuda"]
    assert common.allocation_stack({}) == []


def test_a_block_freed_but_not_yet_released_still_counts(common):
    trace = [
        {"action": "alloc", "addr": 1, "size": 100},
        {"action": "free_requested", "addr": 1, "size": 100},
        {"action": "alloc", "addr": 2, "size": 50},  # the peak: 150, block 1 not yet completed
        {"action": "free_completed", "addr": 1, "size": 100},
    ]
    assert common.peak_allocations(trace) == (150, [trace[0], trace[2]])
