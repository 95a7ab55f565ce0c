"""Sweep launch settings of the Triton layer_norm (backward) and softmax (row-length switches) on
the GPU, and profile one layer_norm fwd+bwd step, so defaults are chosen from data.

    PYTHONPATH=src python benchmarks/kernels/sweep_norms.py
"""

from __future__ import annotations

import itertools

import torch
import triton.testing

import polykernel
from polykernel.backends.triton import layer_norm as ln
from polykernel.backends.triton import softmax as sm


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def layer_norm() -> None:
    m, n = 16384, 4096
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    w, b = torch.randn(n, device="cuda", dtype=torch.bfloat16), torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    gb = m * n * 2 / 1e9
    base = dict(ln.TUNE)
    for elems, warps in itertools.product((1024, 4096, 8192), (None, 4, 8, 16)):
        ln.TUNE.update(base, fwd_tile_elems=elems, fwd_warps=warps)
        ms = bench(lambda: ln.layer_norm_forward(x, w, b, 1e-5))
        print(f"ln fwd elems={elems:5} warps={warps!s:4} {2 * gb / ms * 1e3:6.0f} GB/s")
    ln.TUNE.update(base)
    _y, mean, rstd = ln.layer_norm_forward(x, w, b, 1e-5)
    for elems, warps, per_sm in itertools.product((4096, 8192), (None, 4, 8, 16), (1, 2, 4, 8)):
        ln.TUNE.update(base, bwd_tile_elems=elems, bwd_warps=warps, bwd_programs_per_sm=per_sm)
        ms = bench(lambda: ln.layer_norm_backward(dy, x, w, mean, rstd, b.dtype))
        print(f"ln bwd elems={elems:5} warps={warps!s:4} per_sm={per_sm} {3 * gb / ms * 1e3:6.0f} GB/s")
    ln.TUNE.update(base)


def softmax() -> None:
    x = torch.randn(8192, 32768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    gb = x.numel() * 2 / 1e9
    saved = (sm.MAX_FUSED_N, sm.MAX_FUSED_N_BWD, sm.CHUNK_N, sm.CHUNK_WARPS)
    for fused, fused_bwd, chunk, warps in itertools.product((32768, 16384), (32768, 16384), (4096, 8192), (8, 16)):
        sm.MAX_FUSED_N, sm.MAX_FUSED_N_BWD, sm.CHUNK_N, sm.CHUNK_WARPS = fused, fused_bwd, chunk, warps
        try:
            with torch.no_grad():
                f = bench(lambda: polykernel.softmax(x, impl="triton"))
            fb = bench(lambda: torch.autograd.grad(polykernel.softmax(x, impl="triton"), (x,), dy))
        except Exception as exc:
            print(f"softmax fused={fused} fused_bwd={fused_bwd} chunk={chunk} warps={warps} failed {type(exc).__name__}")
            continue
        print(
            f"softmax fused={fused:5} fused_bwd={fused_bwd:5} chunk={chunk} warps={warps:2} fwd {2 * gb / f * 1e3:6.0f} GB/s  fwd+bwd {5 * gb / fb * 1e3:6.0f} GB/s"
        )
    sm.MAX_FUSED_N, sm.MAX_FUSED_N_BWD, sm.CHUNK_N, sm.CHUNK_WARPS = saved


if __name__ == "__main__":
    layer_norm()
    softmax()
