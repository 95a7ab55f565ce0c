"""benchmarks/models/compile_llama.py on the CPU: the ``--memory`` reading of an allocator trace."""

from __future__ import annotations

import sys
from pathlib import Path

from _scripts import load_benchmark

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "models"))  # its `_child` import
cl = load_benchmark("compile_llama")


def _frames(filename: str, line: int = 1, name: str = "f") -> list[dict]:
    return [{"filename": "/x/torch/nn/functional.py", "line": 9, "name": "inner"}, {"filename": filename, "line": line, "name": name}]


def test_peak_allocations_finds_what_is_alive_at_the_peak():
    events = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": _frames("/m/model.py", 3)},
        {"action": "alloc", "addr": 2, "size": 300, "frames": _frames("/tmp/torchinductor_u/ab/out.py", 7, "call")},
        {"action": "free_requested", "addr": 1, "size": 100},  # not yet released: still counts
        {"action": "alloc", "addr": 3, "size": 50, "frames": []},
        {"action": "free_completed", "addr": 1, "size": 100},
        {"action": "free_completed", "addr": 2, "size": 300},
        {"action": "alloc", "addr": 4, "size": 400},  # a later, lower total (450 < 450 is not a new peak)
        {"action": "free_completed", "addr": 99, "size": 7},  # made before the trace: ignored
    ]
    peak, alive = cl.peak_allocations(events)
    assert peak == 450
    assert [e["addr"] for e in alive] == [2, 1, 3]  # largest first
    assert cl._where(alive[0]) == "/tmp/torchinductor_u/ab/out.py:7 call"  # Inductor's code is shown
    assert cl._where(alive[1]) == "/m/model.py:3 f"  # torch's own frames skipped
    assert cl._where(alive[2]) == "?"


def test_where_reads_cpp_frames_past_the_allocator():
    """The autograd engine's thread has only C++ frames: the first one past the unwinder and the
    allocator names the maker; Python frames still win where there are any."""
    cpp = [
        {"filename": "??", "line": 0, "name": "torch::unwind::unwind()"},
        {"filename": "??", "line": 0, "name": "c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc"},
        {"filename": "??", "line": 0, "name": "at::empty(c10::ArrayRef<long>, c10::TensorOptions)"},
        {"filename": "??", "line": 0, "name": "(anonymous namespace)::RmsNormFn::backward"},
    ]
    assert cl._where({"frames": cpp}) == "(anonymous namespace)::RmsNormFn::backward"
    assert cl._where({"frames": [*cpp, {"filename": "/m/model.py", "line": 3, "name": "f"}]}) == "/m/model.py:3 f"
    assert cl._where({"frames": cpp[:3]}) == "?"
    alive = [{"size": 2**20, "frames": cpp}, {"size": 3 * 2**20, "frames": cpp}, {"size": 2**21, "frames": []}]
    lines = cl._by_site(alive)
    assert lines[0].split() == ["4.0", "MiB", "2x", "(anonymous", "namespace)::RmsNormFn::backward"]
    assert lines[1].split() == ["2.0", "MiB", "1x", "?"]


def test_peak_allocations_of_an_empty_trace():
    assert cl.peak_allocations([]) == (0, [])
