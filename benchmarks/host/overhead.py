"""Hot-path cost of the dispatcher: ``polykernel.rms_norm`` vs the selected impl called directly.

    PYTHONPATH=src python benchmarks/host/overhead.py [--rounds 200] [--calls 200] [--json FILE]

A 1x64 fp32 CPU tensor, so the kernel itself is cheap and the Python around it shows. The
candidates are timed interleaved (one batch of ``--calls`` calls each per round, in turn), and
each reports its best round of ``--rounds``: the best round is the one least disturbed by other
processes, which on a shared machine is the only stable figure.

Two measurements:

- *real impl*: ``polykernel.rms_norm(x, w)`` against the torch impl called directly;
- *dispatch alone*: the memoized decision's callable is swapped for a no-op, so the difference is
  exactly the dispatcher's Python (the repeat test, the subclass/capture guard, call) with no
  kernel noise.

It also says whether the hot path's C guard is active here (``polykernel.core.hit_guard``): without it
every call builds its argument class in Python (~0.4 us more).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from _timer import interleaved_best_us  # (re-exported: the other host benchmarks import it from here)

import polykernel
from polykernel.backends.torch.rms_norm import rms_norm as torch_impl
from polykernel.core import hit_guard, registry
from polykernel.tools.rows import RowFile, announce


def _noop(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, casting: str) -> torch.Tensor:
    return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--json", help="also write the figures to this file (each table as it is measured)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    x, w = torch.randn(1, 64), torch.randn(64)
    assert polykernel.explain("rms_norm", x, w).chosen == "torch"
    # two interleaved tables (4 and 3 candidates, ~1 µs a call); the file ends as before: real, alone, overhead
    announce(2, per_case_s=args.rounds * args.calls * 4 * 1.5e-6 + 1, what="tables", path=args.json)
    out = RowFile(args.json, {"torch": torch.__version__})

    def keep(group: str, table: dict[str, float]) -> None:
        out.add({"group": group, **table}, f"{group}: " + ", ".join(f"{k} {v:.3f} us" for k, v in table.items()))

    real = interleaved_best_us(
        {
            "F.rms_norm (PyTorch)": lambda: F.rms_norm(x, (64,), w, 1e-6),
            "impl, called directly": lambda: torch_impl(x, w, 1e-6, 0.0, "fp32"),
            "polykernel.rms_norm": lambda: polykernel.rms_norm(x, w),
            "polykernel.rms_norm(impl='torch')": lambda: polykernel.rms_norm(x, w, impl="torch"),
        },
        args.rounds,
        args.calls,
    )
    keep("real", real)

    # Dispatch alone: every memoized rms_norm decision runs the no-op instead of the kernel.
    op = registry.get_op("rms_norm")
    polykernel.rms_norm(x, w)
    polykernel.rms_norm(x, w, impl="torch")
    saved = {key: d.fn for key, d in op._memo.items()}
    try:
        for d in op._memo.values():
            d.fn = _noop
        alone = interleaved_best_us(
            {
                "no-op impl, called directly": lambda: _noop(x, w, 1e-6, 0.0, "fp32"),
                "polykernel.rms_norm -> no-op": lambda: polykernel.rms_norm(x, w),
                "polykernel.rms_norm(impl='torch') -> no-op": lambda: polykernel.rms_norm(x, w, impl="torch"),
            },
            args.rounds,
            args.calls,
        )
    finally:
        for key, fn in saved.items():
            if key in op._memo:
                op._memo[key].fn = fn
    keep("alone", alone)

    guard = hit_guard.available() and bool(op._fast)
    print(f"torch {torch.__version__}, 1x64 fp32 on CPU, interleaved, best of {args.rounds} rounds of {args.calls} calls, us per call")
    print(f"  hot-path guard (polykernel.core.hit_guard): {'active' if guard else 'NOT active: argument classes built in Python'}")
    for table, base_name in ((real, "impl, called directly"), (alone, "no-op impl, called directly")):
        base = table[base_name]
        for name, t in table.items():
            print(f"  {name:<44} {t:7.3f} us   ({t - base:+.3f} us vs {base_name.split(',')[0]})")
    overhead = {
        "real_impl_us": real["polykernel.rms_norm"] - real["impl, called directly"],
        "dispatch_alone_us": alone["polykernel.rms_norm -> no-op"] - alone["no-op impl, called directly"],
        "dispatch_alone_impl_arg_us": alone["polykernel.rms_norm(impl='torch') -> no-op"] - alone["no-op impl, called directly"],
    }
    print("  dispatcher overhead: " + ", ".join(f"{k} {v:.3f}" for k, v in overhead.items()))
    out.finish(guard=guard, real=real, alone=alone, overhead=overhead)


if __name__ == "__main__":
    main()
