"""Sweep the Triton rms_norm launch settings on the GPU (forward and backward separately).

    PYTHONPATH=src python benchmarks/kernels/sweep_rms_norm.py

Prints GB/s (forward: 2·M·N·2 bytes; backward alone: 3·M·N·2 bytes, reads x and dy, writes dx)
for each setting, so the defaults in backends/triton/rms_norm.py's TUNE can be chosen from data.
"""

from __future__ import annotations

import itertools

import torch
import triton.testing

from polykernel.backends.triton import rms_norm as k

SHAPES = [(16384, 4096), (4096, 16384), (65536, 1024), (32768, 2048), (2048, 65536)]


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def main() -> None:
    base = dict(k.TUNE)
    for m, n in SHAPES:
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        gb = m * n * 2 / 1e9
        _y, rstd = k.rms_norm_forward(x, w, 1e-6, 0.0, False)
        print(f"== {m}x{n}")
        for elems, warps in itertools.product((1024, 2048, 4096, 8192, 16384), (None, 2, 4, 8, 16)):
            if n > elems and elems != 4096:
                continue
            k.TUNE.update(base, fwd_tile_elems=elems, fwd_warps=warps)
            ms = bench(lambda: k.rms_norm_forward(x, w, 1e-6, 0.0, False))
            print(f"fwd elems={elems:5} warps={warps!s:4} {2 * gb / ms * 1e3:6.0f} GB/s")
        for elems, warps, per_sm in itertools.product((1024, 4096, 8192), (None, 4, 8, 16), (1, 2, 4, 8)):
            if n > elems and elems != 4096:
                continue
            k.TUNE.update(base, bwd_tile_elems=elems, bwd_warps=warps, bwd_programs_per_sm=per_sm)
            try:
                ms = bench(lambda: k.rms_norm_backward(dy, x, w, rstd, 0.0, False))
            except Exception as exc:
                print(f"bwd elems={elems:5} warps={warps!s:4} per_sm={per_sm} failed: {type(exc).__name__}")
                continue
            print(f"bwd elems={elems:5} warps={warps!s:4} per_sm={per_sm} {3 * gb / ms * 1e3:6.0f} GB/s")
        k.TUNE.update(base)


if __name__ == "__main__":
    main()
