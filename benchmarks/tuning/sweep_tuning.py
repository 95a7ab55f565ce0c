"""Measured selection on the GPU: is the tuned choice within 5% of the fastest impl at every size?

    PYTHONPATH=src python benchmarks/tuning/sweep_tuning.py --out DIR          # the H200 sweep (~3-4 min)
    PYTHONPATH=src python benchmarks/tuning/sweep_tuning.py --out DIR --smoke  # CPU, interpreter, seconds

For rms_norm, softmax and cross_entropy in bf16, N = 1K, 2K, ..., 256K (cross_entropy: V = N)
with M = 2^27 / N rows, so that x (the logits) is 256 MiB at every N (1K: 131072 rows; 256K: 512
rows), forward and forward+backward:

- every registered impl that can take the case (``explain``'s verdicts: device, arch, modules,
  dtype and the impl's own predicate; torch, triton, quack, liger, cute_dsl where registered),
  forced with ``impl=``;
- the tuned choice: the public call with ``POLYKERNEL_TUNE=on`` (a fresh store under DIR/cache):
  its first eager call measures and stores, the CUDA-graph capture then runs the stored graph
  choice, which is reported with its time.

Times are GPU time of CUDA-graph replays (``polykernel.tools.bench.measure(graph=True)``, as
``polykernel bench --graph``), ``do_bench(warmup=5, rep=20)``; TB/s over each op's
``bytes_moved``. Writes DIR/sweep_tuning.json, .csv and .png (matplotlib if installed; one panel
per op and mode, TB/s against N per impl, the tuned choice as black rings) and prints, per point,
the fastest impl, the tuned impl and tuned/fastest (time ratio; the claim: <= 1.05 everywhere).
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from polykernel.tools.rows import RowFile, announce

OPS = ("rms_norm", "softmax", "cross_entropy")
TARGET_BYTES = 2**28  # x is 256 MiB in bf16 at every N
CLAIM = 1.05


ROUNDS = 3  # interleaved timing rounds per point (median)


def _sizes(smoke: bool) -> list[tuple[int, int]]:
    """(M, N) pairs: N from 1K to 256K, M so that M·N·2 bytes = 256 MiB."""
    if smoke:
        return [(4, 64), (2, 256)]
    return [(TARGET_BYTES // (2 * n), n) for n in (2**k for k in range(10, 19))]


def _time_cpu(step: Any, reps: int = 3) -> float:
    """--smoke only: wall-clock median in ms (bench.measure needs CUDA)."""
    step()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def _timer(device: str) -> Any:
    """ms of ``fn`` (forward) or ``fn`` + autograd.grad (backward): bench.measure's graph replays."""
    if device == "cuda":
        from polykernel.tools import bench

        return lambda fn, grads, backward: bench.measure(fn, grads, backward, graph=True, warmup=5, rep=20)[0]

    import torch

    def cpu(fn: Any, grads: list[Any], backward: bool) -> float:
        if not backward:
            return _time_cpu(lambda: fn())
        outs = fn()
        cots = [torch.randn_like(o) for o in (outs if isinstance(outs, tuple) else (outs,))]
        return _time_cpu(lambda: torch.autograd.grad(fn(), grads, cots))

    return cpu


def _candidates(op_name: str, args: tuple[Any, ...]) -> dict[str, str | None]:
    """Every registered impl -> None if it can take these arguments, else why not."""
    import polykernel

    rows = polykernel.explain(op_name, *args).impls
    return {r["name"]: (None if r["runnable"] else r["reason"]) for r in rows}


def _tuned_entry(op: Any, args: tuple[Any, ...]) -> dict[str, Any] | None:
    """The tuning entry this process's calls with these arguments used (its eager and graph
    choices, the times), else the store's for their key. The first is the one to trust: its store
    key was built from the call as the dispatcher saw it, with the destinations that a serving
    op's public function allocates (``out=``, q) among its tensors."""
    import torch

    from polykernel import tuning
    from polykernel.tuning import key as tuning_key

    seen = tuning.measured(op, op.key(*args))
    if seen is not None:
        return seen
    key = tuning_key.key(op, op.key(*args), [a for a in args if isinstance(a, torch.Tensor)], torch.are_deterministic_algorithms_enabled())
    return tuning.store().get(key)


def _tuned_graph_choice(op: Any, args: tuple[Any, ...]) -> str | None:
    """The impl the store holds for CUDA-graph capture of this key (eager choice on the CPU)."""
    entry = _tuned_entry(op, args)
    if entry is None:
        return None
    return entry.get("graph" if args[0].device.type == "cuda" else "eager")


def sweep(out: Path, smoke: bool, ops: list[str], sink: RowFile | None = None) -> list[dict[str, Any]]:
    """The rows of every point; each point's rows go to ``sink`` once timed (a cut run keeps them)."""
    import torch

    import polykernel
    from polykernel.core import registry

    device = "cpu" if smoke else "cuda"
    dtype = torch.bfloat16
    timer = _timer(device)
    rows: list[dict[str, Any]] = []
    for op_name in ops:
        op = registry.get_op(op_name)
        public = getattr(polykernel, op.name)
        for m, n in _sizes(smoke):
            for backward in (False, True):
                mode = "fwd+bwd" if backward else "fwd"
                torch.manual_seed(0)
                case = op.example((m, n), dtype, device, requires_grad=backward)
                args = case.args
                grads = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
                nbytes = op.bytes_moved(*args, backward=backward)
                base = {"op": op_name, "mode": mode, "M": m, "N": n, "bytes": nbytes}
                first = len(rows)  # this point's rows start here
                print(f"{op_name} {mode} {m}x{n}", file=sys.stderr, flush=True)
                # Every runnable impl forced with impl=, and the tuned public call (measured and
                # stored on its first, eager, call), timed in ROUNDS interleaved rounds; the median
                # of each. One 20 ms do_bench per point was not enough: the first H200 sweep timed
                # the tuned call 9% below the very impl it ran, which auto_vs_forced.py then
                # measured equal (same kernel, within 0.5%).
                contenders: dict[str, Any] = {}
                for impl, why in _candidates(op_name, args).items():
                    row = {**base, "impl": impl, "ms": None, "TB/s": None, "error": why}
                    rows.append(row)
                    if why is None:
                        contenders[impl] = (row, lambda impl=impl: public(*args, impl=impl))
                tuned = {**base, "impl": "tuned", "ms": None, "TB/s": None, "error": None}
                rows.append(tuned)
                contenders["tuned"] = (tuned, lambda: public(*args))
                samples: dict[str, list[float]] = {name: [] for name in contenders}
                for _ in range(1 if smoke else ROUNDS):
                    for name, (row, fn) in contenders.items():
                        if row["error"] is not None:
                            continue
                        try:
                            samples[name].append(timer(fn, grads, backward))
                        except Exception as exc:  # one impl's failure must not end the sweep
                            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
                        if device == "cuda":
                            torch.cuda.empty_cache()
                for name, (row, _fn) in contenders.items():
                    if row["error"] is None and samples[name]:
                        ms = statistics.median(samples[name])
                        row.update({"ms": ms, "TB/s": nbytes / (ms * 1e-3) / 1e12, "samples_ms": samples[name]})
                if tuned["error"] is None:
                    tuned["chosen"] = _tuned_graph_choice(op, args)
                if sink is not None:
                    for row in rows[first:]:
                        sink.add(row, _row_line(row))
    return rows


def _row_line(row: dict[str, Any]) -> str:
    """One measured row, as printed when it is kept."""
    what = f"{row['ms']:.4f} ms" if row.get("ms") is not None else f"({row.get('error')})"
    return f"{row['op']} {row['mode']} {row['M']}x{row['N']} {row['impl']}{' -> ' + str(row['chosen']) if 'chosen' in row else ''}: {what}"


def summarize(rows: list[dict[str, Any]], dim: str = "N") -> list[dict[str, Any]]:
    """Per (op, mode, size ``dim``): the fastest impl, the tuned impl and tuned/fastest (time ratio)."""
    points: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for r in rows:
        points.setdefault((r["op"], r["mode"], r[dim]), []).append(r)
    out = []
    for (op, mode, n), group in points.items():
        timed = [r for r in group if r["impl"] != "tuned" and r["ms"] is not None]
        tuned = next((r for r in group if r["impl"] == "tuned"), None)
        best = min(timed, key=lambda r: r["ms"]) if timed else None
        ratio = tuned["ms"] / best["ms"] if best and tuned and tuned["ms"] is not None else math.nan
        out.append(
            {
                "op": op,
                "mode": mode,
                dim: n,
                "fastest": best["impl"] if best else None,
                "fastest_ms": best["ms"] if best else None,
                "fastest_TB/s": best["TB/s"] if best else None,
                "tuned": (tuned or {}).get("chosen"),
                "tuned_ms": (tuned or {}).get("ms"),
                "ratio": ratio,
                "within_claim": bool(ratio <= CLAIM),
            }
        )
    return out


def print_table(summary: list[dict[str, Any]]) -> None:
    print(f"{'op':<14}{'mode':<9}{'N':>8}  {'fastest':<10}{'TB/s':>7}  {'tuned':<10}{'tuned/fastest':>14}")
    for s in summary:
        tbs = f"{s['fastest_TB/s']:.2f}" if s["fastest_TB/s"] is not None else "-"
        flag = "" if s["within_claim"] else "  > 5%"
        print(
            f"{s['op']:<14}{s['mode']:<9}{s['N']:>8}  {s['fastest'] or '-':<10}{tbs:>7}  {s['tuned'] or '-':<10}{s['ratio']:>14.3f}{flag}"
        )
    worst = max((s["ratio"] for s in summary if not math.isnan(s["ratio"])), default=math.nan)
    held = sum(s["within_claim"] for s in summary)
    print(f"tuned within 5% of the fastest at {held} of {len(summary)} points; worst tuned/fastest {worst:.3f}")


def plot(
    rows: list[dict[str, Any]],
    summary: list[dict[str, Any]],
    path: Path,
    x: str = "N",
    y: str = "TB/s",
    title: str = "{op} {mode} (bf16, 256 MiB)",
    log_y: bool = False,
    cols: int = 1,
    order: tuple[str, ...] = OPS,
) -> bool:
    """One panel per op and mode (``cols`` to a row, ops in ``order``): ``y`` against ``x`` per
    impl, the tuned choice ringed. False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    modes = list(dict.fromkeys(r["mode"] for r in rows))  # in the rows' order
    panels = sorted(
        {(r["op"], r["mode"]) for r in rows}, key=lambda p: (order.index(p[0]) if p[0] in order else 99, p[0], modes.index(p[1]))
    )
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(8 * cols, 3.2 * nrows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    # one color per impl across the panels
    color = {impl: f"C{i % 10}" for i, impl in enumerate(sorted({r["impl"] for r in rows} - {"tuned"}))}
    for ax, (op, mode) in zip(axes.flat, panels):
        impls = sorted({r["impl"] for r in rows if r["op"] == op and r["mode"] == mode and r["impl"] != "tuned"})
        for impl in impls:
            pts = sorted((r[x], r[y]) for r in rows if (r["op"], r["mode"], r["impl"]) == (op, mode, impl) and r[y])
            if pts:
                ax.plot(*zip(*pts), marker="o", label=impl, color=color[impl])
        tuned = sorted((r[x], r[y]) for r in rows if (r["op"], r["mode"], r["impl"]) == (op, mode, "tuned") and r[y])
        if tuned:
            ax.plot(*zip(*tuned), linestyle="none", marker="o", markersize=11, markerfacecolor="none", color="black", label="tuned")
        ax.set_xscale("log", base=2)
        if log_y:
            ax.set_yscale("log")
        ax.set_title(title.format(op=op, mode=mode))
        ax.set_xlabel(x)
        ax.set_ylabel(y)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def prepare(parser: argparse.ArgumentParser, out_dir: str, smoke: bool) -> Path:
    """The output folder, made; then, before polykernel and triton are imported: a fresh store
    under it, measuring on, the interpreter on the CPU (``smoke``), else a CUDA GPU required."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    os.environ["POLYKERNEL_TUNE"] = "on"
    os.environ["POLYKERNEL_CACHE_DIR"] = str(out / "cache")
    if smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        import torch

        if not torch.cuda.is_available():
            parser.error("needs a CUDA GPU (or --smoke)")
    import polykernel

    polykernel.clear_caches()
    if not smoke:
        ready_native()
    return out


def ready_native() -> None:
    """The native launch path built before the first point: a fresh POLYKERNEL_CACHE_DIR has no
    build, and the first CUDA call would start one in the background and launch from Python
    meanwhile (2026-12-04, the serving sweeps: the first ops' eager rows measured the Python
    path)."""
    import time

    from polykernel.backends.triton import _native

    t = time.perf_counter()
    mod = _native.module(wait=True)
    print(
        f"native launch path: {'ready' if mod is not None else 'not usable here (the Python path runs)'} ({time.perf_counter() - t:.0f} s)",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for sweep_tuning.{json,csv,png} and the tuning store")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU through Triton's interpreter (a test of the script)")
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    a = p.parse_args(argv)
    out = prepare(p, a.out, a.smoke)
    started = time.perf_counter()
    import torch

    meta: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if not a.smoke else "cpu (smoke)",
        "torch": torch.__version__,
        "dtype": "bfloat16",
        "sizes": "M = 2^27 / N rows: x (logits) 256 MiB at every N" if not a.smoke else "smoke",
        "timing": "CUDA-graph replays, do_bench(warmup=5, rep=20)" if not a.smoke else "CPU wall clock",
    }
    # {"meta", "complete", "rows", "summary"}: the rows written per point, the summary at the end
    sink = RowFile(out / "sweep_tuning.json", {"meta": meta})
    points = len(a.ops) * len(_sizes(a.smoke)) * 2
    announce(points, per_case_s=2 if a.smoke else 4, what="points (op, size, mode)", path=str(sink.path))
    rows = sweep(out, a.smoke, a.ops, sink)
    summary = summarize(rows)
    meta["seconds"] = round(time.perf_counter() - started, 1)
    sink.finish(summary=summary)
    with open(out / "sweep_tuning.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["op", "mode", "M", "N", "impl", "chosen", "ms", "TB/s", "bytes", "error"], extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    plotted = plot(rows, summary, out / "sweep_tuning.png")
    print_table(summary)
    print(f"wrote {out / 'sweep_tuning.json'}, .csv{', .png' if plotted else ' (no matplotlib: no plot)'} in {meta['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
