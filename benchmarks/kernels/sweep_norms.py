"""Sweep launch settings of the Triton layer_norm (backward) and softmax (row-length switches) on
the GPU, so defaults are chosen from data.

    PYTHONPATH=src python benchmarks/kernels/sweep_norms.py [--json FILE]

``--json FILE`` keeps the rows, written as they are measured.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton.testing

import polykernel
from polykernel.backends.triton import layer_norm as ln
from polykernel.backends.triton import softmax as sm
from polykernel.tools.rows import RowFile, announce

LN_FWD = list(itertools.product((1024, 4096, 8192), (None, 4, 8, 16)))  # (tile elems, warps)
LN_BWD = list(itertools.product((4096, 8192), (None, 4, 8, 16), (1, 2, 4, 8)))  # (tile elems, warps, programs per SM)
SOFTMAX = list(itertools.product((32768, 16384), (32768, 16384), (4096, 8192), (8, 16)))  # (fused, fused bwd, chunk, warps)


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def layer_norm(out: RowFile) -> None:
    m, n = 16384, 4096
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    w, b = torch.randn(n, device="cuda", dtype=torch.bfloat16), torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    gb = m * n * 2 / 1e9
    base = dict(ln.TUNE)
    for elems, warps in LN_FWD:
        ln.TUNE.update(base, fwd_tile_elems=elems, fwd_warps=warps)
        ms = bench(lambda: ln.layer_norm_forward(x, w, b, 1e-5))
        row = {"op": "layer_norm", "pass": "fwd", "elems": elems, "warps": warps, "ms": ms, "GBps": 2 * gb / ms * 1e3}
        out.add(row, f"ln fwd elems={elems:5} warps={warps!s:4} {row['GBps']:6.0f} GB/s")
    ln.TUNE.update(base)
    _y, mean, rstd = ln.layer_norm_forward(x, w, b, 1e-5)
    for elems, warps, per_sm in LN_BWD:
        ln.TUNE.update(base, bwd_tile_elems=elems, bwd_warps=warps, bwd_programs_per_sm=per_sm)
        ms = bench(lambda: ln.layer_norm_backward(dy, x, w, mean, rstd, b.dtype))
        row = {"op": "layer_norm", "pass": "bwd", "elems": elems, "warps": warps, "per_sm": per_sm, "ms": ms, "GBps": 3 * gb / ms * 1e3}
        out.add(row, f"ln bwd elems={elems:5} warps={warps!s:4} per_sm={per_sm} {row['GBps']:6.0f} GB/s")
    ln.TUNE.update(base)


def softmax(out: RowFile) -> None:
    x = torch.randn(8192, 32768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    gb = x.numel() * 2 / 1e9
    saved = (sm.MAX_FUSED_N, sm.MAX_FUSED_N_BWD, sm.CHUNK_N, sm.CHUNK_WARPS)
    for fused, fused_bwd, chunk, warps in SOFTMAX:
        sm.MAX_FUSED_N, sm.MAX_FUSED_N_BWD, sm.CHUNK_N, sm.CHUNK_WARPS = fused, fused_bwd, chunk, warps
        row = {"op": "softmax", "fused": fused, "fused_bwd": fused_bwd, "chunk": chunk, "warps": warps}
        try:
            with torch.no_grad():
                f = bench(lambda: polykernel.softmax(x, impl="triton"))
            fb = bench(lambda: torch.autograd.grad(polykernel.softmax(x, impl="triton"), (x,), dy))
        except Exception as exc:
            out.add(
                {**row, "error": type(exc).__name__},
                f"softmax fused={fused} fused_bwd={fused_bwd} chunk={chunk} warps={warps} failed {type(exc).__name__}",
            )
            continue
        row.update(fwd_ms=f, fwd_GBps=2 * gb / f * 1e3, fwd_bwd_ms=fb, fwd_bwd_GBps=5 * gb / fb * 1e3)
        out.add(
            row,
            f"softmax fused={fused:5} fused_bwd={fused_bwd:5} chunk={chunk} warps={warps:2} fwd {row['fwd_GBps']:6.0f} GB/s  fwd+bwd {row['fwd_bwd_GBps']:6.0f} GB/s",
        )
    sm.MAX_FUSED_N, sm.MAX_FUSED_N_BWD, sm.CHUNK_N, sm.CHUNK_WARPS = saved


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None, help="keep the rows here, written as measured (default: printed only)")
    a = p.parse_args(argv)
    announce(len(LN_FWD) + len(LN_BWD) + 2 * len(SOFTMAX), per_case_s=1.5, what="settings (softmax: fwd and fwd+bwd)", path=a.json)
    out = RowFile(a.json, {"device": torch.cuda.get_device_name(), "dtype": "bfloat16"})
    layer_norm(out)
    softmax(out)
    out.finish()


if __name__ == "__main__":
    main()
