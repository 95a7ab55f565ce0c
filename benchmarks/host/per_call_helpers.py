"""Per-call cost of the small functions the hot path calls besides ``Op.dispatch``.

    PYTHONPATH=src python benchmarks/host/per_call_helpers.py [--rounds 200] [--calls 1000] [--json FILE]

The first three were generated per arity with ``codegen.define`` until 2026-12-03 and are now
closures in plain source (run this at both commits to compare them); the Triton launch key stays
generated, timed here against ``plain_launch_key``, its plain-source candidate
(``benchmarks/results/cpu-2026-12-03-plain-dispatch/``):

- the hot-path guard of a call with a None tensor slot (``cross_entropy`` without class weights;
  ``polykernel.core.hit_guard.build``);
- the tensor-subclass check of the slow path (``polykernel.core.hot_path.plain_check``), which
  every call of an op without a guard takes;
- the element counts of a decision tuned per size (``polykernel.tuning.by_size._sizes_fn``);
- the fast Triton launch's argument key (``polykernel.backends.triton._launch``), for a kernel
  of 4 tensors, 4 ints and a float (rms_norm's forward), generated and in plain source.

CPU, one thread; interleaved, each candidate's best round.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from polykernel.backends.triton import _launch
from polykernel.core import hit_guard, registry
from polykernel.core.hot_path import plain_check
from polykernel.tools.rows import RowFile, announce
from polykernel.tuning.by_size import _sizes_fn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import interleaved_best_us


def plain_launch_key(args: tuple[Any, ...]) -> Callable[..., tuple[Any, ...]]:
    """The launch key as a closure over the argument kinds: the same entries as the generated one."""
    kinds = tuple(
        "tensor" if isinstance(a, torch.Tensor) else "int" if type(a) is int else "value" if a is None or type(a) is bool else "type"
        for a in args
    )

    def key(*a: Any) -> tuple[Any, ...]:
        out: list[Any] = []
        for kind, v in zip(kinds, a):
            if kind == "tensor":
                out += (v.dtype, not v.data_ptr() & 15)
            elif kind == "int":
                out += (type(v), v == 1, not v & 15, -0x80000000 <= v <= 0x7FFFFFFF, v <= 0x7FFFFFFFFFFFFFFF)
            elif kind == "value":
                out += (type(v), v)
            else:
                out.append(type(v))
        return tuple(out)

    return key


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    announce(1, per_case_s=args.rounds * args.calls * 5 * 0.5e-6 + 1, what="tables", path=args.json)
    out = RowFile(args.json, {"torch": torch.__version__, "guard": hit_guard.available()})

    ce = registry.get_op("loss.cross_entropy")
    logits, target = torch.randn(4, 32), torch.randint(0, 32, (4,))
    ce_args = (logits, target, -100, 0.0, "mean", None, None, 0.0)
    guard = hit_guard.build(ce.guard, ce_args)
    assert guard is None or guard(logits, target, None)
    check = plain_check(ce.reference)
    x, w = torch.randn(8, 64), torch.randn(64)
    sizes = _sizes_fn((x, w, 1e-6, 0.0, "fp32"))
    y, rstd = torch.empty_like(x), torch.empty(8)
    launch_args = (x, w, y, rstd, 8, 64, 64, 64, 1e-6)
    key = _launch._arg_key_function(launch_args)
    plain_key = plain_launch_key(launch_args)
    assert plain_key(*launch_args) == key(*launch_args)
    fns = {
        "plain tensors check (cross_entropy's 8 args)": lambda: check(ce_args),
        "element counts (rms_norm's 2 tensors)": lambda: sizes((x, w, 1e-6, 0.0, "fp32")),
        "Triton launch key (4 tensors, 4 ints, a float)": lambda: key(*launch_args),
        "Triton launch key, plain-source candidate": lambda: plain_key(*launch_args),
        "no-op": lambda: None,
    }
    if guard is not None:
        fns["guard with a None slot (cross_entropy)"] = lambda: guard(logits, target, None)
    table = interleaved_best_us(fns, args.rounds, args.calls)
    base = table.pop("no-op")
    for name, t in table.items():
        out.add({"what": name, "us": t - base}, f"  {name:<48} {t - base:.3f} us")
    out.finish(complete=True)


if __name__ == "__main__":
    main()
