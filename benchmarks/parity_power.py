"""The power of the parity checks, by mutation: how many one-bug impls ``check_parity`` kills.

Each mutant is an op's reference (run in the call's dtypes, so its own rounding is that of a
correct impl) with ONE realistic bug: an output or a single gradient off by 1e-3..1e-2, a
gradient missing its last row, or an op-specific bug (eps misplaced, a dropped term, halves
swapped, a wrong denominator). A mutant that passes every one of the op's cases in fp32 and bf16
is a survivor: the harness would ship that bug. CPU only; run from the repository root::

    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/parity_power.py [op-substring ...]

tests/core/test_parity_power.py runs a small fixed set of these mutants and asserts each is killed.
"""

from __future__ import annotations

import inspect
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import polykernel
from polykernel.core import registry
from polykernel.spec import CapabilityRequirement
from polykernel.testing import check_parity, isolated

BACKEND = "cuda_jit"  # a name no CPU impl uses: the mutant takes it inside isolated()


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward scales the gradient (or drops its last row: ``s=None``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, s: float | None) -> torch.Tensor:
        ctx.s = s
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        if ctx.s is not None:
            return g * ctx.s, None
        g = g.clone()
        if g.dim() and g.shape[0]:
            g[-1] = 0
        return g, None


def _floats(out: Any) -> list[torch.Tensor]:
    outs = out if isinstance(out, tuple) else (out,)
    return [o for o in outs if isinstance(o, torch.Tensor) and o.is_floating_point() and o.element_size() > 1]


def scaled_output(ref: Callable[..., Any], writes: tuple[int, ...], s: float) -> Callable[..., Any]:
    def impl(*args: Any) -> Any:
        out = ref(*args)
        if writes:  # serving ops: the destinations hold the result
            for i in writes:
                if args[i].is_floating_point() and args[i].element_size() > 1:
                    args[i].mul_(s)
            return out
        if isinstance(out, tuple):
            return tuple(o * s if isinstance(o, torch.Tensor) and o.is_floating_point() else o for o in out)
        return out * s

    return impl


def zero_last_output_row(ref: Callable[..., Any], writes: tuple[int, ...]) -> Callable[..., Any]:
    """The last row of the first output left 0 (a grid one program short)."""

    def impl(*args: Any) -> Any:
        out = ref(*args)
        first = args[writes[0]] if writes else (out[0] if isinstance(out, tuple) else out)
        if first.dim() and first.shape[0]:
            if writes:
                first[-1] = 0
            else:
                first = first.clone()
                first[-1] = 0
                out = (first, *out[1:]) if isinstance(out, tuple) else first
        return out

    return impl


def grad_mutant(ref: Callable[..., Any], i: int, s: float | None) -> Callable[..., Any]:
    def impl(*args: Any) -> Any:
        args = list(args)
        if isinstance(args[i], torch.Tensor) and args[i].requires_grad:
            args[i] = _ScaleGrad.apply(args[i], s)
        return ref(*args)

    return impl


def generic(op: Any) -> dict[str, Callable[..., Any]]:
    ref = op.reference
    params = list(inspect.signature(ref).parameters)
    writes = tuple(params.index(w) for w in op.writes)
    out = {
        "out*1.01": scaled_output(ref, writes, 1.01),
        "out*1.001": scaled_output(ref, writes, 1.001),
        "out last row 0": zero_last_output_row(ref, writes),
    }
    if not writes:
        case = op.cases("cpu", torch.float32)[0]
        for c in op.cases("cpu", torch.float32):
            for k, a in enumerate(c.args):
                if isinstance(a, torch.Tensor) and a.requires_grad and f"d{params[k]}*1.01" not in out:
                    out[f"d{params[k]}*1.01"] = grad_mutant(ref, k, 1.01)
                    out[f"d{params[k]} last row 0"] = grad_mutant(ref, k, None)
        del case
    return out


def specific(op: Any) -> dict[str, Callable[..., Any]]:
    from _parity_mutants import MUTANTS  # op-specific bugs (tests/_parity_mutants.py)

    return {name: fn for name, fn in MUTANTS.get(op.id, {}).items()}


def run(op_id: str, name: str, fn: Callable[..., Any], dtypes: list[torch.dtype]) -> tuple[bool, float, str, dict[str, float]]:
    """(survived, worst error ratio, worst case, worst per dtype) of one mutant over the op's cases."""
    op = registry.get_op(op_id)
    with isolated():
        polykernel.register_impl(op=op.name, backend=BACKEND, rank=1, capabilities=frozenset({CapabilityRequirement.CPU}))(fn)
        results = check_parity(op, [BACKEND], dtypes=dtypes)
    worst, where, per = 0.0, "", {}
    for r in results:
        e = max(r.forward_error, r.backward_error)
        if e != e or r.message:  # NaN or a message: raised / wrong shape: killed
            e = float("inf")
        per[r.dtype] = max(per.get(r.dtype, 0.0), e)
        if e > worst:
            worst, where = e, f"{r.case} {r.dtype}"
    return all(r.ok for r in results), worst, where, per


def main(filters: list[str]) -> None:
    sys.path.insert(0, "tests")
    ops = sorted(registry.load_catalog())
    survivors = []
    for op_id in ops:
        if filters and not any(f in op_id for f in filters):
            continue
        op = registry.get_op(op_id)
        dtypes = [torch.float32, torch.bfloat16]
        mutants = specific(op) if "--specific" in sys.argv else {**generic(op), **specific(op)}
        t = time.time()
        control = run(op_id, "reference", op.reference, dtypes)
        print(f"{op_id}: reference-as-impl {'ok' if control[0] else 'FAILS'} worst {control[1]:.3g} ({control[2]})", flush=True)
        for name, fn in mutants.items():
            survived, worst, where, per = run(op_id, name, fn, dtypes)
            tag = "SURVIVED" if survived else "killed"
            by = " ".join(f"{d}={e:.3g}" for d, e in per.items())
            print(f"  {name:32} {tag:9} worst {worst:.3g} ({where}) [{by}]", flush=True)
            if survived:
                survivors.append((op_id, name, worst))
        print(f"  ({time.time() - t:.0f} s)", flush=True)
    print("\nsurvivors:")
    for s in survivors:
        print(f"  {s[0]:36} {s[1]:32} worst {s[2]:.3g}")


if __name__ == "__main__":
    main([a for a in sys.argv[1:] if not a.startswith("--")])
