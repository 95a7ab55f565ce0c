"""Hot-path cost of the dispatcher: polykernel.rms_norm vs the selected impl called directly.

    PYTHONPATH=src python benchmarks/overhead.py

A tiny CPU tensor (4x64 fp32), so the kernel itself is cheap and the Python around it shows.
Reports the median of 15 repeats of 20000 calls each, in microseconds per call.
"""

from __future__ import annotations

import statistics
import timeit

import torch
import torch.nn.functional as F

import polykernel
from polykernel.backends.torch.rms_norm import rms_norm as torch_impl


def per_call_us(fn, number: int = 20000, repeat: int = 15) -> float:
    fn()
    return statistics.median(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def main() -> None:
    torch.set_num_threads(1)
    x, w = torch.randn(4, 64), torch.randn(64)
    assert polykernel.explain("rms_norm", x, w).chosen == "torch"
    rows = {
        "F.rms_norm (PyTorch)": lambda: F.rms_norm(x, (64,), w, 1e-6),
        "selected impl, called directly": lambda: torch_impl(x, w, 1e-6, 0.0, "fp32"),
        "polykernel.rms_norm": lambda: polykernel.rms_norm(x, w),
        "polykernel.rms_norm(impl='torch')": lambda: polykernel.rms_norm(x, w, impl="torch"),
    }
    times = {name: per_call_us(fn) for name, fn in rows.items()}
    base = times["selected impl, called directly"]
    print(f"torch {torch.__version__}, 4x64 fp32 on CPU, median us per call")
    for name, t in times.items():
        print(f"  {name:<36} {t:6.2f} us   ({t - base:+.2f} us vs the impl)")


if __name__ == "__main__":
    main()
