"""Where QuACK's RMSNorm impls lead Triton's, by row length and row count: the data behind
``backends/quack/_gates.py``'s rank rules (the argument class knows N and the dtype, not the rows).

    PYTHONPATH=src python benchmarks/kernels/sweep_norm_peers.py [--json FILE] [--ops rms_norm,fused_add_rms_norm]

Each row: one op, shape, pass (fwd, fwd+bwd) and impl, GPU time of a CUDA-graph replay (median,
``triton.testing.do_bench_cudagraph``) and bytes moved per the op's ``bytes_moved``. Impls that
are not available here (QuACK without CuTeDSL's native library) give error rows. ``--json FILE``
keeps the rows, written as they are measured.
"""

from __future__ import annotations

import argparse

import torch
import triton.testing

import polykernel
from polykernel.tools.rows import RowFile, announce

SHAPES = [(r, n) for n in (2048, 4096, 8192) for r in (1024, 4096, 16384)] + [
    (r, n) for n in (16384, 32768, 65536) for r in (1024, 2048, 4096)
]
IMPLS = ("triton", "quack")


def _inputs(op: str, rows: int, n: int, grad: bool) -> tuple[torch.Tensor, ...]:
    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=grad)

    return (t(rows, n), t(n)) if op == "rms_norm" else (t(rows, n), t(rows, n), t(n))


def _call(op: str, impl: str, args: tuple[torch.Tensor, ...]):
    fn = getattr(polykernel, op)
    return fn(*args, impl=impl)


def measure(op: str, impl: str, rows: int, n: int, grad: bool) -> float:
    args = _inputs(op, rows, n, grad)
    if not grad:
        with torch.no_grad():
            _call(op, impl, args)  # compile and verify outside the graph
            return triton.testing.do_bench_cudagraph(lambda: _call(op, impl, args), rep=50, return_mode="median")
    outs = _call(op, impl, args)
    outs = outs if isinstance(outs, tuple) else (outs,)
    dys = [torch.randn_like(o) for o in outs]

    # autograd.grad, not backward: backward's AccumulateGrad into .grad, made on the default
    # stream, invalidated the capture on the side stream, and every later row failed with it
    # (benchmarks/results/h100-2026-12-06-twentyfirst/overhead-graph/norm-peers.log)
    def step() -> None:
        o = _call(op, impl, args)
        torch.autograd.grad(o if isinstance(o, tuple) else (o,), args, dys)

    step()
    return triton.testing.do_bench_cudagraph(step, rep=50, return_mode="median")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None, help="keep the rows here, written as measured")
    p.add_argument("--ops", default="fused_add_rms_norm,rms_norm")
    a = p.parse_args(argv)
    ops = a.ops.split(",")
    announce(len(ops) * len(SHAPES) * 2 * len(IMPLS), per_case_s=0.8, what="op x shape x pass x impl", path=a.json)
    out = RowFile(a.json, {"device": torch.cuda.get_device_name(), "dtype": "bfloat16", "torch": torch.__version__})
    for op in ops:
        for rows, n in SHAPES:
            for grad in (False, True):
                for impl in IMPLS:
                    row = {"op": op, "shape": f"{rows}x{n}", "rows": rows, "n": n, "pass": "fwd+bwd" if grad else "fwd", "impl": impl}
                    try:
                        ms = measure(op, impl, rows, n, grad)
                    except Exception as exc:  # an impl that is not available here is a row too
                        out.add({**row, "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
                        continue
                    out.add({**row, "ms": ms}, f"{op:20} {rows:6}x{n:<6} {row['pass']:8} {impl:9} {ms * 1e3:9.1f} us")
                torch.cuda.empty_cache()
    out.finish()


if __name__ == "__main__":
    main()
