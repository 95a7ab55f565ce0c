"""Cross-entropy gradient strategies and the fused linear CE impls, forward+backward (H200).

PYTHONPATH=src python benchmarks/kernels/ce_variants.py [--json FILE]
"""

import argparse

import torch
import triton.testing

import polykernel
import polykernel.backends.triton.cross_entropy as tce
from polykernel.tools.rows import RowFile, announce


def ms(fn, rep=100):
    return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None, help="keep the rows here, written as measured (default: printed only)")
    a = p.parse_args(argv)
    announce(4, per_case_s=5, what="rows", path=a.json)  # 2 gradient strategies, 2 fused linear CE impls
    out = RowFile(a.json, {"device": torch.cuda.get_device_name(), "dtype": "bfloat16"})
    n, h, v = 8192, 4096, 128256
    t = torch.randint(0, v, (n,), device="cuda")
    x = torch.randn(n, v, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def ce():
        torch.autograd.grad(polykernel.cross_entropy(x, t, impl="triton"), (x,))

    for g in (False, True):
        tce.GRAD_IN_FORWARD = g
        took = ms(ce)
        row = {"op": "cross_entropy", "shape": f"{n}x{v}", "variant": f"GRAD_IN_FORWARD={g}", "ms": took}
        out.add(row, f"cross_entropy {n}x{v} bf16 fwd+bwd, GRAD_IN_FORWARD={g}: {took:.3f} ms")
    tce.GRAD_IN_FORWARD = False
    x.grad = None
    hid = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(v, h, device="cuda", dtype=torch.bfloat16) / 64).requires_grad_()
    for impl in ("triton", "torch"):

        def flce(impl=impl):
            torch.autograd.grad(polykernel.fused_linear_cross_entropy(hid, w, t, impl=impl), (hid, w))

        took = ms(flce, 20)
        row = {"op": "fused_linear_cross_entropy", "shape": f"{n}x{h}x{v}", "variant": impl, "ms": took}
        out.add(row, f"fused_linear_cross_entropy N={n} H={h} V={v} bf16 fwd+bwd [{impl}]: {took:.2f} ms")
    out.finish()


if __name__ == "__main__":
    main()
