"""Host (CPU) time per call of GPU launches, without synchronizing: what limits small, fast steps.

PYTHONPATH=src python benchmarks/host/host_overhead.py [--json FILE]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import polykernel
from polykernel.backends.triton import rms_norm as tk
from polykernel.tools.rows import RowFile, announce


def host_us(fn, n: int = 2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
        torch.cuda.synchronize()
    return best


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None, help="keep the rows here, written as measured (default: printed only)")
    a = p.parse_args(argv)
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    dy = torch.randn_like(x)
    _y, rstd = tk.rms_norm_forward(x, w, 1e-6, 0.0, False)
    rows = {
        "empty_like (one torch op)": lambda: torch.empty_like(x),
        "F.rms_norm": lambda: F.rms_norm(x, (4096,), w, 1e-6),
        "polykernel.rms_norm torch impl": lambda: polykernel.rms_norm(x, w, impl="torch"),
        "triton launcher rms_norm_forward": lambda: tk.rms_norm_forward(x, w, 1e-6, 0.0, False),
        "polykernel.rms_norm triton (no grad)": lambda: polykernel.rms_norm(x, w, impl="triton"),
        "triton launcher rms_norm_backward": lambda: tk.rms_norm_backward(dy, x, w, rstd, 0.0, False),
        "fwd+bwd triton via autograd": lambda: torch.autograd.grad(polykernel.rms_norm(xg, wg, impl="triton"), (xg, wg), dy),
        "fwd+bwd torch via autograd": lambda: torch.autograd.grad(polykernel.rms_norm(xg, wg, impl="torch"), (xg, wg), dy),
    }
    announce(len(rows), per_case_s=1, what="calls timed", path=a.json)
    out = RowFile(a.json, {"device": torch.cuda.get_device_name(), "shape": "64x4096", "dtype": "bfloat16"})
    for name, fn in rows.items():
        us = host_us(fn)
        out.add({"call": name, "host_us": us}, f"{name:<40} {us:7.1f} us host per call")
    out.finish()


if __name__ == "__main__":
    main()
