"""On the H200: cuTile impls next to Triton and torch.compile at issue 9's target shapes.

    source /opt/pk/env.sh   # after `bash ../shared/gpu/stage.sh cutile` (tileiras 13.4; unsets CUDA_HOME)
    PYTHONPATH=src python3 benchmarks/kernels/bench_cutile.py --out DIR [--op rms_norm ...] [--no-compile] [--graph]

Timing and the copy reference are ``polykernel bench``'s own (:func:`polykernel.tools.bench.measure`,
:func:`polykernel.tools.bench.copy_bandwidth`): ``triton.testing.do_bench`` medians, fwd+bwd as a forward
plus ``torch.autograd.grad`` with fixed random cotangents drawn before any timing; ``--graph``
times CUDA-graph replays instead (captured on a side stream after a warm-up, as ``measure`` does).
At these sizes (0.1-1 ms per step) the launch cost is noise, so the default needs no capture.
bf16. TB/s over each op's fewest bytes (the op file's ``bytes_moved``: swiglu and geglu 3·M·N·2
fwd, 8·M·N·2 fwd+bwd; rms_norm 2·M·N·2 and 5·M·N·2; softmax 2·M·N·2; rope reads q, k, cos, sin
and writes q, k, twice for fwd+bwd) and % of a 2 GiB device copy. Before timing, each
contender's forward output is compared with the Triton impl's (max abs difference, in the JSON):
a quick sanity check, not the parity test (tests/test_cutile.py is). Writes DIR/bench_cutile.json
and DIR/bench_cutile.csv; prints a table. About a minute with --no-compile.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import polykernel
from polykernel.core import registry
from polykernel.tools.bench import copy_bandwidth, measure
from polykernel.tools.rows import RowFile, announce

# (op, shape, kwargs, modes, target TB/s per mode): issue 9's table
CASES: list[tuple[str, tuple[int, ...], dict[str, Any], dict[str, float]]] = [
    ("swiglu", (16384, 14336), {}, {"fwd": 4.2, "fwd+bwd": 4.2}),
    ("geglu", (16384, 14336), {}, {"fwd": 4.2, "fwd+bwd": 4.2}),
    ("rms_norm", (16384, 4096), {}, {"fwd": 3.9, "fwd+bwd": 3.4}),
    ("rope", (4, 32, 4096, 128), {}, {"fwd": 3.9, "fwd+bwd": 3.8}),
    ("softmax", (8192, 32768), {}, {"fwd": 4.0}),
]


def contenders(op_name: str, use_compile: bool) -> dict[str, Callable[..., Any]]:
    fn = getattr(polykernel, op_name)
    out: dict[str, Callable[..., Any]] = {}
    for impl in ("triton", "cutile"):  # triton first: the others are compared with its output
        out[impl] = lambda *a, _i=impl, **k: fn(*a, impl=_i, **k)
    if use_compile:
        out["torch.compile"] = torch.compile(registry.get_op(op_name).reference, dynamic=False)
    return out


def _tensors(out: Any) -> list[torch.Tensor]:
    return [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]


def bench_case(
    op_name: str,
    shape: tuple[int, ...],
    kwargs: dict[str, Any],
    modes: dict[str, float],
    copy: float,
    use_compile: bool,
    graph: bool = False,
    device: str = "cuda",
    out: RowFile | None = None,
) -> list[dict[str, Any]]:
    """One row per (mode, contender): ms and TB/s from ``polykernel.tools.bench.measure`` (``device``
    other than CUDA only for a smoke test of the bookkeeping, with ``measure`` replaced)."""
    op = registry.get_op(op_name)
    rows = []
    torch.manual_seed(0)
    # one set of inputs for every mode and contender, drawn before anything is timed or captured
    args = op.example(shape, torch.bfloat16, device, requires_grad=True).args
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    calls = contenders(op_name, use_compile)
    for mode, target in modes.items():
        backward = mode == "fwd+bwd"
        nbytes = op.bytes_moved(*args, backward=backward)
        baseline = None
        for name, fn in calls.items():
            row: dict[str, Any] = dict(op=op_name, shape="x".join(map(str, shape)), mode=mode, impl=name, target_tbs=target)
            try:
                with torch.no_grad():
                    first = [t.float() for t in _tensors(fn(*args, **kwargs))]
                if baseline is None:
                    baseline = first
                row["max_abs_diff_vs_triton"] = max((t - b).abs().max().item() for t, b in zip(first, baseline))
                del first
                ms, peak = measure(lambda fn=fn: fn(*args, **kwargs), leaves, backward, graph=graph)
                tbs = nbytes / ms / 1e9
                row.update(ms=round(ms, 4), tbs=round(tbs, 3), pct_copy=round(100 * tbs / copy, 1), meets_target=tbs >= target)
                row["peak_extra_MiB"] = round(peak)
            except Exception as exc:  # one contender's failure must not stop the run
                row.update(ms=None, tbs=None, error=f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            rows.append(row)
            if out is not None:  # written now: a run cut at its time limit keeps it
                out.add(row, json.dumps(row))
            else:
                print(json.dumps(row), flush=True)
            if device == "cuda":
                torch.cuda.empty_cache()
        triton_tbs = next((r.get("tbs") for r in rows if r["mode"] == mode and r["impl"] == "triton"), None)
        for r in rows:
            if r["mode"] == mode and r.get("tbs") and triton_tbs:
                r["vs_triton"] = round(r["tbs"] / triton_tbs, 3)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for bench_cutile.json / .csv")
    p.add_argument("--op", nargs="*", default=None, help="ops to run (default: all five)")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile (saves its compile time)")
    p.add_argument("--graph", action="store_true", help="time CUDA-graph replays (polykernel.tools.bench.measure(graph=True))")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_cutile needs a CUDA GPU", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    for op_name in ("swiglu", "geglu", "rms_norm", "rope", "softmax"):
        print(polykernel.explain(op_name, device="cuda", dtype=torch.bfloat16), flush=True)
    copy = copy_bandwidth() / 1e3  # GB/s -> TB/s
    print(f"2 GiB copy: {copy:.3f} TB/s", flush=True)
    meta = dict(
        device=torch.cuda.get_device_name(), torch=torch.__version__, timing="graph" if a.graph else "do_bench", copy_tbs=round(copy, 3)
    )
    rows_file = RowFile(out / "bench_cutile.json", {"meta": meta})
    cases = [c for c in CASES if not a.op or c[0] in a.op]
    announce(sum(len(c[3]) for c in cases) * 4, per_case_s=3, what="rows (about)", path=str(out / "bench_cutile.json"))
    rows: list[dict[str, Any]] = []
    for op_name, shape, kwargs, modes in cases:
        rows += bench_case(op_name, shape, kwargs, modes, copy, not a.no_compile, a.graph, out=rows_file)
    meta["seconds"] = round(time.time() - t0, 1)
    rows_file.finish()  # (with each mode's vs_triton, filled in after its rows)
    keys = ["op", "shape", "mode", "impl", "ms", "tbs", "pct_copy", "vs_triton", "target_tbs", "meets_target", "max_abs_diff_vs_triton",
            "peak_extra_MiB", "error"]  # fmt: skip
    with open(out / "bench_cutile.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    print(f"\n{'op':9} {'mode':8} {'impl':14} {'ms':>8} {'TB/s':>6} {'%copy':>6} {'/triton':>7} target")
    for r in rows:
        ms = f"{r['ms']:.4f}" if r.get("ms") else "-"
        tbs = f"{r['tbs']:.2f}" if r.get("tbs") else "-"
        pct = f"{r['pct_copy']:.0f}" if r.get("pct_copy") else "-"
        mark = ("ok" if r.get("meets_target") else "MISS") if r["impl"] == "cutile" and r.get("tbs") else r.get("error", "")
        rel = f"{r['vs_triton']:.2f}" if r.get("vs_triton") else "-"
        print(f"{r['op']:9} {r['mode']:8} {r['impl']:14} {ms:>8} {tbs:>6} {pct:>6} {rel:>7} {r['target_tbs']} {mark}")
    print(f"({meta['seconds']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
