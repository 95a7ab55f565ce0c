"""Cross-entropy gradient strategies and the fused linear CE impls, forward+backward (H200).

PYTHONPATH=src python benchmarks/kernels/ce_variants.py
"""

import torch
import triton.testing

import polykernel
import polykernel.backends.triton.cross_entropy as tce


def ms(fn, rep=100):
    return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")


def main() -> None:
    n, h, v = 8192, 4096, 128256
    t = torch.randint(0, v, (n,), device="cuda")
    x = torch.randn(n, v, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def ce():
        torch.autograd.grad(polykernel.cross_entropy(x, t, impl="triton"), (x,))

    for g in (False, True):
        tce.GRAD_IN_FORWARD = g
        print(f"cross_entropy {n}x{v} bf16 fwd+bwd, GRAD_IN_FORWARD={g}: {ms(ce):.3f} ms")
    tce.GRAD_IN_FORWARD = False
    x.grad = None
    hid = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(v, h, device="cuda", dtype=torch.bfloat16) / 64).requires_grad_()
    for impl in ("triton", "torch"):

        def flce(impl=impl):
            torch.autograd.grad(polykernel.fused_linear_cross_entropy(hid, w, t, impl=impl), (hid, w))

        print(f"fused_linear_cross_entropy N={n} H={h} V={v} bf16 fwd+bwd [{impl}]: {ms(flce, 20):.2f} ms")


if __name__ == "__main__":
    main()
