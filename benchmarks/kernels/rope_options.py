"""rope's options and mrope on a CUDA GPU: the Triton impl next to the torch impl (eager) and
``torch.compile`` of the reference, fwd and fwd+bwd, bf16, in TB/s of the op's ``bytes_moved``.

    PYTHONPATH=src python benchmarks/kernels/rope_options.py --json benchmarks/results/h200-rope-options.json

Rows: the default rotate-half (the reference row: the options must not have slowed it), GLM4's
partial interleaved rotary (R = D/2), Phi-3-mini's partial rotate-half (R = 3D/4), GPT-J/Llama4's
interleaved full rotary, and Qwen2-VL's mrope, at q ``[4, 32, 4096, 128]`` (k 8 heads) in HF's
transposed layout. ``--tiny`` runs a small shape on the CPU (torch only: a check of the script).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

import polykernel
from polykernel.ops import mrope as mrope_op
from polykernel.ops import rope as rope_op
from polykernel.tools.rows import RowFile, announce

# label -> (rotary dim as a fraction of D, interleaved); None: mrope
ROWS: dict[str, tuple[float, bool] | None] = {
    "rotate-half": (1.0, False),
    "glm4-partial-interleaved": (0.5, True),
    "phi3-partial": (0.75, False),
    "gptj-interleaved": (1.0, True),
    "mrope": None,
}


def _args(label: str, shape: tuple[int, int, int, int], hk: int, device: str, dtype: torch.dtype) -> tuple[tuple[Any, ...], dict[str, Any]]:
    b, hq, t, d = shape

    def hf(h: int) -> torch.Tensor:  # a [B, T, H*D] projection viewed [B, H, T, D]
        return torch.randn(b, t, h * d, device=device, dtype=dtype).view(b, t, h, d).transpose(1, 2).requires_grad_()

    q, k = hf(hq), hf(hk)
    spec = ROWS[label]
    if spec is None:
        cos, sin = mrope_op._tables(b, t, d, dtype, device)
        return (q, k, cos, sin, mrope_op.sections_for(d)), {}
    frac, interleaved = spec
    rd = int(d * frac)
    cos, sin = rope_op._rope_tables(1, t, rd, dtype, device)
    if interleaved:  # GPT-J tables: each angle for its pair
        cos, sin = (x[..., : rd // 2].repeat_interleave(2, dim=-1) for x in (cos, sin))
    return (q, k, cos, sin), {"interleaved": interleaved}


def _time(fn: Any, bwd: bool, cuda: bool) -> float:
    """Milliseconds per call (fwd, or fwd+bwd with a fixed cotangent)."""

    def run() -> None:
        outs = fn()
        if bwd:
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    if cuda:
        from polykernel.timing import do_bench

        return do_bench(run)
    import time

    run()
    t0 = time.perf_counter()
    run()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--tiny", action="store_true", help="a small shape on the CPU, torch only")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    shape, hk = ((4, 32, 4096, 128), 8) if cuda else ((1, 4, 16, 32), 2)
    impls = ["triton", "torch", "compile"] if cuda else ["torch"]
    setup = {
        "shape": shape,
        "k_heads": hk,
        "dtype": str(dtype).removeprefix("torch."),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
    }
    out = RowFile(args.json, {"setup": setup})  # each row kept as measured
    announce(len(ROWS) * len(impls) * 2, per_case_s=3 if cuda else 0.2, what="rows", path=str(args.json))
    for label in ROWS:
        a, kw = _args(label, shape, hk, device, dtype)
        op = polykernel.mrope if ROWS[label] is None else polykernel.rope
        ref = mrope_op.reference if ROWS[label] is None else rope_op.reference
        moved = (mrope_op if ROWS[label] is None else rope_op).bytes_moved
        compiled = torch.compile(lambda *x, ref=ref, kw=kw: ref(*x, **kw)) if "compile" in impls else None
        for impl in impls:
            for bwd in (False, True):
                if impl == "compile":
                    fn = lambda a=a, c=compiled: c(*a)
                else:
                    fn = lambda a=a, kw=kw, impl=impl, op=op: op(*a, **kw, impl=impl)
                ms = _time(fn, bwd, cuda)
                tbs = moved(*a[:4], backward=bwd) / (ms * 1e-3) / 1e12
                row = {"row": label, "impl": impl, "mode": "fwd+bwd" if bwd else "fwd", "ms": ms, "tb_per_s": tbs}
                out.add(row, f"{label:26s} {impl:8s} {'fwd+bwd' if bwd else 'fwd':8s} {ms:8.3f} ms {tbs:6.2f} TB/s")
    out.finish()


if __name__ == "__main__":
    main()
