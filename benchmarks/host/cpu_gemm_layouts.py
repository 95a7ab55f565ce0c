"""torch's CPU GEMM in half precision by operand layout, and what polykernel.core.cpu_gemm.mm makes
of it: the reason for that helper (the torch impls' chunked backward GEMMs, ``dH = dZ @ W``).

    PYTHONPATH=src python benchmarks/host/cpu_gemm_layouts.py [--reps 3] [--json FILE]

Rows: ``[M, K] @ [K, N]`` for each dtype and layout pair (``rr``: both row-major, as ``dZ`` and
``W`` are; ``rc``, ``cr``, ``cc``), ``torch.mm`` as it comes and through ``cpu_gemm.mm``, the median
of ``--reps`` calls after one warm-up; GFLOP/s = 2·M·K·N / time. Then the fused linear
cross-entropy's forward and backward at the README quickstart's shape (64 rows, H = 1024,
V = 32000, bf16), its torch impl, through ``cpu_gemm.mm`` and with ``torch.mm`` as it comes. CPU
only (CUDA's GEMMs take any layout).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import polykernel
from polykernel.core import cpu_gemm
from polykernel.core.cpu_gemm import mm
from polykernel.tools.rows import RowFile, announce

SHAPES = [(64, 32000, 1024), (32000, 64, 1024)]  # dH = dZ @ W at the quickstart's shape, and dW = dZᵀ @ H
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _median_s(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _layout(t: torch.Tensor, code: str) -> torch.Tensor:
    return t.t().contiguous().t() if code == "c" else t.contiguous()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    header = {
        "device": "cpu",
        "torch": torch.__version__,
        "capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
    }
    out = RowFile(args.json, header)
    n_rows = len(SHAPES) * len(DTYPES) * 4 + 2
    announce(n_rows, 8.0, "rows", args.json)  # a same-layout half-precision row: seconds a call
    g = torch.Generator().manual_seed(0)
    for m, k, n in SHAPES:
        for dtype in DTYPES:
            a0, b0 = torch.randn(m, k, generator=g).to(dtype), torch.randn(k, n, generator=g).to(dtype)
            for code in ("rr", "rc", "cr", "cc"):
                a, b = _layout(a0, code[0]), _layout(b0, code[1])
                row = {"shape": f"{m}x{k}x{n}", "dtype": str(dtype).removeprefix("torch."), "layouts": code}
                for name, fn in (("torch_mm", lambda: torch.mm(a, b)), ("cpu_gemm_mm", lambda: mm(a, b))):
                    s = _median_s(fn, args.reps)
                    row[f"{name}_ms"], row[f"{name}_gflops"] = s * 1e3, 2 * m * k * n / s / 1e9
                out.add(
                    row,
                    f"{row['shape']:>16} {row['dtype']:>8} {code}  torch.mm {row['torch_mm_ms']:9.1f} ms   cpu_gemm.mm {row['cpu_gemm_mm_ms']:9.1f} ms",
                )
    h = torch.randn(64, 1024, generator=g).to(torch.bfloat16).requires_grad_()
    w = torch.randn(32000, 1024, generator=g).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, 32000, (64,), generator=g)

    def step():
        polykernel.fused_linear_cross_entropy(h, w, t, impl="torch").backward()

    for through in ("cpu_gemm_mm", "torch_mm"):  # the op as it runs, then with the helper passing operands through
        if through == "torch_mm":
            cpu_gemm.operands = lambda a, b: (a, b)
        s = _median_s(step, args.reps)
        row = {"case": "fused_linear_cross_entropy fwd+bwd, N=64 H=1024 V=32000 bf16, impl=torch", "gemm": through, "ms": s * 1e3}
        out.add(row, f"{row['case']}, {through}: {row['ms']:.1f} ms")
    out.finish()


if __name__ == "__main__":
    main()
