"""Host cost of ``refusing()`` (backends/_double_backward.py): a peer's autograd Function
with and without the subclass that makes double backward raise instead of reading zeros.

    PYTHONPATH=src python benchmarks/host/peer_refusing.py [--rounds 100] [--calls 200] [--json FILE]

A stand-in peer Function (x·x·w on a 4x8 fp32 CPU tensor, its backward under no_grad, as a
Liger kernel's would be) so the Python around it shows; a real Liger Function runs on CUDA
only. On the H200 host, with liger_kernel installed, it also times ``LigerRMSNormFunction``
itself (``--cuda``). Candidates are timed interleaved; each reports its best round.

- forward: ``apply`` alone (the subclass stores the inputs, or their empty anchors);
- forward+backward: ``apply`` then ``backward`` (the subclass reads one flag more).
"""

from __future__ import annotations

import argparse

import torch
from _timer import interleaved_best_us

from polykernel.backends._double_backward import refusing
from polykernel.tools.rows import RowFile, announce


class _Peer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, eps):  # type: ignore[override]
        ctx.save_for_backward(x, w)
        return x * x * w + eps

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        x, w = ctx.saved_tensors
        with torch.no_grad():
            return 2 * g * x * w, (g * x * x).sum(0), None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--cuda", action="store_true", help="also time LigerRMSNormFunction on CUDA")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    kept = refusing(_Peer, "norm.stand_in", "peer", (0, 1))
    anchored = refusing(_Peer, "norm.stand_in", "peer", (0, 1), kept=False)
    a, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, requires_grad=True)
    x = a * 1.5  # a non-leaf input, as a layer's activation is
    leaf = torch.randn(4, 8, requires_grad=True)

    def fwd_bwd(fn):
        def run():
            y = fn.apply(leaf, w, 1e-6)
            y.backward(torch.ones_like(y))

        return run

    fns = {
        "fwd plain": lambda: _Peer.apply(x, w, 1e-6),
        "fwd refusing (kept)": lambda: kept.apply(x, w, 1e-6),
        "fwd refusing (anchored)": lambda: anchored.apply(x, w, 1e-6),
        "fwd+bwd plain": fwd_bwd(_Peer),
        "fwd+bwd refusing (kept)": fwd_bwd(kept),
    }
    if args.cuda:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        guarded = refusing(LigerRMSNormFunction, "norm.rms_norm", "liger", (0, 1))
        xc = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True) * 1
        wc = torch.ones(4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        fns["liger rms_norm fwd plain"] = lambda: LigerRMSNormFunction.apply(xc, wc, 1e-6, 0.0, "llama", False)
        fns["liger rms_norm fwd refusing"] = lambda: guarded.apply(xc, wc, 1e-6, 0.0, "llama", False)
    # one interleaved table (its figures exist once all rounds end): the row; the file keeps the old flat keys too
    announce(len(fns), per_case_s=(args.rounds + 1) * args.calls * 20e-6, what="candidates timed interleaved", path=args.json)
    sink = RowFile(args.json, {}, echo=lambda line: line and print(line, flush=True))
    best = interleaved_best_us(fns, args.rounds, args.calls)
    out = dict(best)
    out["overhead kept (us)"] = best["fwd refusing (kept)"] - best["fwd plain"]
    out["overhead anchored (us)"] = best["fwd refusing (anchored)"] - best["fwd plain"]
    out["overhead fwd+bwd kept (us)"] = best["fwd+bwd refusing (kept)"] - best["fwd+bwd plain"]
    if args.cuda:
        out["overhead liger rms_norm (us)"] = best["liger rms_norm fwd refusing"] - best["liger rms_norm fwd plain"]
    sink.add({"table": "best_us", **out}, "")
    for k, v in out.items():
        print(f"{k:36s} {v:8.2f}")
    sink.finish(**out)


if __name__ == "__main__":
    main()
