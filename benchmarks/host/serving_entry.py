"""Host cost of the serving ops' entry: ``polykernel.<op>(...)`` at one token against its impl.

    PYTHONPATH=src python benchmarks/host/serving_entry.py [--device cpu|cuda] [--rounds 60]
        [--calls 200] [--json FILE]

A decode step calls each serving op once per layer on one token, so the Python around the kernel
is the step's cost when the GPU is not the bottleneck (eager serving). Per op, every memoized
decision's impl is swapped for a no-op that returns the op's destinations, so the difference
between the public call and the no-op called directly (with destinations made beforehand) is
exactly the entry: its checks (the class's and memory's), the destinations' allocation, the
dispatch and the version bumps. Interleaved, best round of ``--rounds`` (overhead.py's method),
under ``torch.inference_mode()`` as a server runs. Each row is written as it is measured.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _timer import interleaved_best_us  # (plain Python: this script also runs on older trees)

import polykernel
from polykernel.core import registry

try:
    from polykernel.tools.rows import RowFile, announce
except ImportError:  # an older tree (ab_overhead.sh's A/B runs this script on it): the same file format
    import json

    def announce(n: int, **_: Any) -> None:
        print(f"{n} cases")

    class RowFile:  # type: ignore[no-redef]
        def __init__(self, path: str | None, header: dict[str, Any]) -> None:
            self.path, self.header, self.rows = path, header, []

        def add(self, row: dict[str, Any], line: str) -> None:
            print(line, flush=True)
            self.rows.append(row)
            if self.path:
                Path(self.path).write_text(json.dumps({**self.header, "complete": False, "rows": self.rows}, indent=1))


def cases(dev: str, dtype: torch.dtype) -> list[tuple[str, str, Callable[[], Any], Callable[[], Any], Callable[..., Any]]]:
    """(label, op id, the public call, the no-op called directly, the no-op impl) at one token."""

    def t(*shape: int) -> torch.Tensor:
        return torch.randn(shape, device=dev).to(dtype)

    x2, out = t(1, 2 * 4096), t(1, 4096)
    x, r, w = t(1, 4096), t(1, 4096), t(4096)
    pos, q, k = torch.zeros(1, dtype=torch.long, device=dev), t(1, 32 * 128), t(1, 8 * 128)
    cache = torch.randn(4096, 128, device=dev)
    scale = torch.full((1,), 0.01, device=dev)
    q8, s8 = torch.empty(1, 4096, dtype=torch.float8_e4m3fn, device=dev), torch.empty(1, 1, device=dev)

    def last(*args: Any) -> Any:
        return args[-1]

    def q_scale(x: Any, per_token: Any, q: Any, s: Any) -> Any:
        return q, s

    def two(a: Any, b: Any, *_: Any) -> Any:
        return a, b

    def qk(p: Any, q: Any, k: Any, *_: Any) -> Any:
        return q, k

    return [
        ("silu_and_mul", "serving.silu_and_mul", lambda: polykernel.silu_and_mul(x2), lambda: last(x2, out), last),
        ("silu_and_mul out=", "serving.silu_and_mul", lambda: polykernel.silu_and_mul(x2, out=out), lambda: last(x2, out), last),
        ("gelu_and_mul", "serving.gelu_and_mul", lambda: polykernel.gelu_and_mul(x2), lambda: last(x2, "none", out), last),
        (
            "fused_add_rms_norm_",
            "serving.fused_add_rms_norm_",
            lambda: polykernel.fused_add_rms_norm_(x, r, w),
            lambda: two(x, r, w, 1e-6, 0.0),
            two,
        ),
        (
            "rotary_embedding_",
            "serving.rotary_embedding_",
            lambda: polykernel.rotary_embedding_(pos, q, k, 128, cache),
            lambda: qk(pos, q, k, 128, cache, True, 128),
            qk,
        ),
        ("static_quant_fp8", "serving.static_quant_fp8", lambda: polykernel.static_quant_fp8(x, scale), lambda: last(x, scale, q8), last),
        (
            "dynamic_quant_fp8",
            "serving.dynamic_quant_fp8",
            lambda: polykernel.dynamic_quant_fp8(x),
            lambda: q_scale(x, True, q8, s8),
            q_scale,
        ),
        (
            "rms_norm_quant_fp8",
            "serving.rms_norm_quant_fp8",
            lambda: polykernel.rms_norm_quant_fp8(x, w, scale),
            lambda: last(x, w, scale, 1e-6, q8),
            last,
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--json", help="also write the rows to this file (each as it is measured)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    with torch.inference_mode():
        todo = cases(args.device, dtype)
        announce(len(todo), per_case_s=args.rounds * args.calls * 2 * 8e-6 + 1, what="ops", path=args.json)
        rows = RowFile(args.json, {"torch": torch.__version__, "device": args.device, "dtype": str(dtype)})
        for label, op_id, public, direct, noop in todo:
            op = registry.get_op(op_id)
            public()  # the decision made (and verified) with the real impl, then swapped
            saved = {key: d.fn for key, d in op._memo.items()}
            try:
                for d in op._memo.values():
                    d.fn = noop
                best = interleaved_best_us({"public": public, "direct": direct}, args.rounds, args.calls)
            finally:
                for key, fn in saved.items():
                    if key in op._memo:
                        op._memo[key].fn = fn
            entry = best["public"] - best["direct"]
            rows.add(
                {"op": label, "public_us": best["public"], "noop_direct_us": best["direct"], "entry_us": entry},
                f"{label:<22} entry {entry:6.3f} us (public -> no-op {best['public']:.3f}, no-op direct {best['direct']:.3f})",
            )


if __name__ == "__main__":
    main()
