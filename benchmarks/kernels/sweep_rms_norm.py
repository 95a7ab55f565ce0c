"""Sweep the Triton rms_norm launch settings on the GPU (forward and backward separately).

    PYTHONPATH=src python benchmarks/kernels/sweep_rms_norm.py [--json FILE]

Prints GB/s (forward: 2·M·N·2 bytes; backward alone: 3·M·N·2 bytes, reads x and dy, writes dx)
for each setting, so the defaults in backends/triton/rms_norm.py's TUNE can be chosen from data.
``--json FILE`` keeps the rows, written as they are measured.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton.testing

from polykernel.backends.triton import rms_norm as k
from polykernel.tools.rows import RowFile, announce

SHAPES = [(16384, 4096), (4096, 16384), (65536, 1024), (32768, 2048), (2048, 65536)]


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def settings(n: int) -> tuple[list[tuple], list[tuple]]:
    """The forward (elems, warps) and backward (elems, warps, programs per SM) settings for row length ``n``."""
    fwd = [(e, w) for e, w in itertools.product((1024, 2048, 4096, 8192, 16384), (None, 2, 4, 8, 16)) if n <= e or e == 4096]
    bwd = [(e, w, p) for e, w, p in itertools.product((1024, 4096, 8192), (None, 4, 8, 16), (1, 2, 4, 8)) if n <= e or e == 4096]
    return fwd, bwd


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None, help="keep the rows here, written as measured (default: printed only)")
    a = p.parse_args(argv)
    announce(sum(len(f) + len(b) for f, b in (settings(n) for _, n in SHAPES)), per_case_s=1.5, what="settings", path=a.json)
    out = RowFile(a.json, {"device": torch.cuda.get_device_name(), "dtype": "bfloat16"})
    base = dict(k.TUNE)
    for m, n in SHAPES:
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        gb = m * n * 2 / 1e9
        _y, rstd = k.rms_norm_forward(x, w, 1e-6, 0.0, False)
        print(f"== {m}x{n}", flush=True)
        fwd, bwd = settings(n)
        for elems, warps in fwd:
            k.TUNE.update(base, fwd_tile_elems=elems, fwd_warps=warps)
            ms = bench(lambda: k.rms_norm_forward(x, w, 1e-6, 0.0, False))
            row = {"shape": f"{m}x{n}", "pass": "fwd", "elems": elems, "warps": warps, "ms": ms, "GBps": 2 * gb / ms * 1e3}
            out.add(row, f"fwd elems={elems:5} warps={warps!s:4} {row['GBps']:6.0f} GB/s")
        for elems, warps, per_sm in bwd:
            k.TUNE.update(base, bwd_tile_elems=elems, bwd_warps=warps, bwd_programs_per_sm=per_sm)
            row = {"shape": f"{m}x{n}", "pass": "bwd", "elems": elems, "warps": warps, "per_sm": per_sm}
            try:
                ms = bench(lambda: k.rms_norm_backward(dy, x, w, rstd, 0.0, False))
            except Exception as exc:
                out.add(
                    {**row, "error": type(exc).__name__},
                    f"bwd elems={elems:5} warps={warps!s:4} per_sm={per_sm} failed: {type(exc).__name__}",
                )
                continue
            row.update(ms=ms, GBps=3 * gb / ms * 1e3)
            out.add(row, f"bwd elems={elems:5} warps={warps!s:4} per_sm={per_sm} {row['GBps']:6.0f} GB/s")
        k.TUNE.update(base)
    out.finish()


if __name__ == "__main__":
    main()
