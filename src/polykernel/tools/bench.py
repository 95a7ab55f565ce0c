"""``polykernel bench``: polykernel next to eager PyTorch and torch.compile, in one process and one
run, on a CUDA GPU. The peers that are installed (Liger-Kernel, QuACK) are registered impls
(``polykernel:liger``, ``polykernel:quack``) and are measured as such.

    $ polykernel bench                                   # every op, README shapes, bf16, per call
    $ polykernel bench rms_norm softmax --graph          # GPU time only (CUDA-graph replays)
    $ polykernel bench --graph --sweep --plot --out benchmarks/results   # + sizes per op, a PNG
    $ polykernel bench --load benchmarks/results/h200-2026-12-01-graph.json --plot out.png  # re-plot

Each row is written to ``<out>/<device>-<date>-<graph|call>.json`` and printed as soon as it is
measured (:mod:`polykernel.tools.rows`): a run cut at a time limit keeps its rows (``"complete":
false`` in the file), and an estimate of the run time is printed before measuring starts.

Rows, per case (op, shape, mode): ``impl="polykernel"`` is the automatic choice, as a user's call
gets it, with the impl it chose in ``chosen``; then one row per registered impl forced with
``impl=`` (``polykernel:triton``, ``polykernel:torch``, the peers' ``polykernel:liger`` ...), the op's
reference in plain PyTorch (``eager reference``) and ``torch.compile`` of that reference.

Timing (:mod:`polykernel.timing`): ``triton.testing.do_bench`` medians (it flushes L2 between runs). Forward times one call
(the serving ops, inference only, have no other row; the in-place ones rewrite their inputs on
every call, as an engine does); "fwd+bwd" times a forward plus ``torch.autograd.grad`` of every
output with a fixed random cotangent. GB/s counts the fewest bytes the op must move (each op
file's ``bytes_moved``: state the formula there); the fused linear cross-entropy reports TFLOP/s from 2·N·H·V (forward) and
6·N·H·V (forward+backward), the MoE experts from the routed work, 6·T·k·H·I (forward) and
18·T·k·H·I (forward+backward), next to transformers' own experts (its ``grouped_mm``
implementation and its eager loop over experts) where transformers is installed. "% copy" is against a 2 GiB device-to-device copy measured at the
start of the same run (bytes read + written). Peak extra memory is reported for every row.
"host µs" (per-call mode) is the CPU time to issue one step while the GPU is kept busy
(:func:`host_us_per_call`): an eager call costs max(GPU time, host time).

``--sweep`` adds, per op, sizes along the leading dimension (the README shape and three smaller
ones, largest first). To keep a full sweep within a few minutes: the extra sizes are timed with
``do_bench(warmup=10, rep=40)`` instead of (25, 100), and ``torch.compile`` keeps one compiled
reference per op and row length, so a sweep costs one static and one dynamic-shape compile per
mode (what ``torch.compile``'s default automatic dynamic shapes give a user) instead of one per size.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

# Shared with the tuner; bench's names for them (benchmarks/ import them from here).
from ..timing import capture_graph, copy_bandwidth, do_bench, host_us_per_call
from . import bench_shapes, options
from .bench_contenders import _contenders, transformers_experts, transformers_gpt_oss_experts  # noqa: F401 (re-exported)
from .bench_report import _row_line, _write_csv, check_result, print_rows
from .bench_shapes import _FLOPS, _PREFERENCE, OPTIONS, SHAPES, _label, cases_for, shapes_for, sweep_shapes  # noqa: F401 (re-exported)
from .rows import RowFile, announce, load

if TYPE_CHECKING:
    import torch
    from rich.console import Console


def _outputs(out: Any) -> list[torch.Tensor]:
    import torch

    return [o for o in (out if isinstance(out, tuple) else (out,)) if isinstance(o, torch.Tensor) and o.requires_grad]


def peak_extra_mib(step: Callable[[], Any]) -> float:
    """MiB that one call of ``step`` holds at its peak beyond what was allocated before it (CUDA)."""
    import torch

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def measure(
    fn: Callable[[], Any], grad_inputs: list[torch.Tensor], backward: bool, graph: bool = False, warmup: int = 25, rep: int = 100
) -> tuple[float, float]:
    """(median ms, peak extra MiB) of fn (forward) or fn + autograd.grad (forward+backward).

    ``graph=True`` captures the step in a CUDA graph and times its replays: GPU time alone, with
    the host's launch cost (Python, autograd, Triton's launcher) taken out.
    """
    import torch

    if backward:
        cots = [torch.randn_like(o) for o in _outputs(fn())]

        def step() -> Any:
            return torch.autograd.grad(_outputs(fn()), grad_inputs, cots)

    else:

        def step() -> Any:
            with torch.no_grad():
                return fn()

    step()
    peak = peak_extra_mib(step)
    if graph:
        ms = do_bench(capture_graph(step).replay, warmup=warmup, rep=rep)
    else:
        ms = do_bench(step, warmup=warmup, rep=rep)
    return ms, peak


def _step(fn: Callable[[], Any], grad_inputs: list[torch.Tensor], backward: bool) -> Callable[[], Any]:
    """One call as ``measure`` times it: the forward under no_grad, or forward + autograd.grad."""
    import torch

    if not backward:
        return lambda: torch.no_grad()(fn)()
    cots = [torch.randn_like(o) for o in _outputs(fn())]
    return lambda: torch.autograd.grad(_outputs(fn()), grad_inputs, cots)


def _chosen(op_id: str, backward: bool) -> str:
    """The impl(s) the dispatcher used for the automatic row (its decisions since the last clear;
    under CUDA-graph capture the capture's own decision is among them)."""
    import polykernel

    used = {d["impl"] for d in polykernel.decisions(op_id) if bool(d["arg_class"].get("needs_grad")) == backward}
    return "+".join(sorted(used))


def _perf(row: dict[str, Any], op: Any, shape: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any], copy: float) -> None:
    backward = row["mode"].startswith("fwd+bwd")
    ms = row["ms"]
    if op.name in _FLOPS:
        n, h, v = shape
        row["size"] = _FLOPS[op.name](n, h, v, False) / 1e9  # GFLOP forward: the plot's x
        row["TFLOP/s"] = _FLOPS[op.name](n, h, v, backward) / (ms * 1e-3) / 1e12
    elif op.name in _PREFERENCE:  # matmul-bound: the op file's flops (DPO, KTO: + a reference head given)
        flops = importlib.import_module(f"polykernel.ops.{op.name}").flops
        row["size"] = flops(*args, backward=False, **kwargs) / 1e9
        row["TFLOP/s"] = flops(*args, backward=backward, **kwargs) / (ms * 1e-3) / 1e12
    elif op.name in ("moe_experts", "moe_experts_gpt_oss"):
        from polykernel.ops import moe_experts, moe_experts_gpt_oss

        flops = (moe_experts if op.name == "moe_experts" else moe_experts_gpt_oss).flops
        row["size"] = flops(*args, backward=False) / 1e9  # GFLOP forward: the plot's x
        row["TFLOP/s"] = flops(*args, backward=backward) / (ms * 1e-3) / 1e12
    elif op.bytes_moved is not None:
        row["size"] = op.bytes_moved(*args, backward=False, **kwargs) / 2**20  # MiB forward: the plot's x
        gbs = op.bytes_moved(*args, backward=backward, **kwargs) / (ms * 1e-3) / 1e9
        row["GB/s"], row["% copy"] = gbs, 100 * gbs / copy


def run(
    ops: list[str],
    use_compile: bool,
    dtype: torch.dtype,
    graph: bool = False,
    sweep: bool = False,
    console: Console | None = None,
    device: str = "cuda",
    out: RowFile | None = None,
) -> tuple[list[dict[str, Any]], float]:
    """Measure every contender on every case of ``ops``; (rows, copy GB/s). ``device`` other than
    CUDA is for tests of the bookkeeping (with ``measure`` replaced). With ``out``, each row is
    written there (and printed) as soon as it is measured: a run cut at its time limit keeps them."""
    import torch

    import polykernel
    from polykernel.core import registry
    from polykernel.tools.console import make_console, progress

    con = console or make_console()
    copy = copy_bandwidth()
    name = torch.cuda.get_device_name() if device == "cuda" else device
    con.print(f"# {name} | torch {torch.__version__} | copy 2 GiB: {copy:.0f} GB/s")
    plan = [(registry.get_op(name), *case) for name in ops for case in cases_for(registry.get_op(name).name, sweep)]
    if out is not None:
        out.header["copy_GBps"] = copy
    announce(
        sum(_rows_per_case(op, use_compile) for op, *_ in plan),
        ROW_BUDGET_S,
        "rows",
        out.path if out is not None else None,
        extra_s=COMPILE_BUDGET_S * len({(op.name, shape[-1]) for op, _, shape, _ in plan}) * use_compile,
        print_=lambda line: con.print(line, markup=False, highlight=False),
    )
    readme = {(op.name, s) for op in {op for op, *_ in plan} for _, s in shapes_for(op.name)}  # the full-length timings
    rows: list[dict[str, Any]] = []
    compiled: dict[tuple[str, int], Callable[..., Any]] = {}
    with progress(con) as bar:
        task = bar.add_task("bench", total=len(plan))
        for op, label, shape, in_sweep in plan:
            bar.update(task, description=f"{op.name} {label}")
            case = op.example(shape, dtype, device, True)
            args, kwargs = case.args, {**case.kwargs, **OPTIONS.get((op.name, label), {})}
            grad_inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
            fn = None
            if use_compile:  # one per op and row length: sizes along the leading dim share it
                fn = compiled.setdefault((op.name, shape[-1]), torch.compile(op.reference))
            timing = {"warmup": 25, "rep": 100} if (op.name, shape) in readme else {"warmup": 10, "rep": 40}
            modes = (False,) if op.writes else (False, True)  # the serving ops (Op.writes) have no backward
            for who, call in _contenders(op, args, kwargs, dtype, fn, device).items():
                for backward in modes:
                    t0 = time.time()
                    if who == "polykernel":
                        polykernel.clear_caches()  # so decisions() holds this row's choice only
                    host = float("nan")
                    try:
                        ms, peak = measure(call, grad_inputs, backward, graph, **timing)
                        err = ""
                        if device == "cuda" and not graph:  # host time to issue the step (see host_us_per_call)
                            host = host_us_per_call(_step(call, grad_inputs, backward))
                    except Exception as exc:
                        ms, peak, err = float("nan"), float("nan"), f"{type(exc).__name__}: {str(exc)[:120]}"
                    row: dict[str, Any] = {
                        "op": op.name,
                        "shape": label,
                        "dtype": str(dtype).removeprefix("torch."),
                        "mode": ("fwd+bwd" if backward else "fwd") + (" graph" if graph else ""),
                        "impl": who,
                        "chosen": _chosen(op.id, backward) if who == "polykernel" else "",
                        "sweep": in_sweep,
                        "ms": ms,
                        "host_us": host,
                        "peak_extra_MiB": peak,
                        "error": err,
                        "seconds": round(time.time() - t0, 2),
                    }
                    _perf(row, op, shape, args, kwargs, copy)
                    rows.append(row)
                    if out is not None:
                        out.add(row, _row_line(row))
            bar.advance(task)
            if bar.disable:  # plain output: a line per case instead of the bar
                con.print(f"{op.name} {label}: done ({sum(r['shape'] == label and r['op'] == op.name for r in rows)} rows)")
            del case, args, kwargs, grad_inputs
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows, copy


# The run-time estimate printed before measuring: a row is a do_bench of ~0.1 s warm-up + timing,
# the host-time measurement and a first call; a torch.compile reference compiles once per op and
# row length and mode.
ROW_BUDGET_S = 1.5
COMPILE_BUDGET_S = 60.0


def _rows_per_case(op: Any, use_compile: bool) -> int:
    from polykernel.core import registry

    contenders = 1 + len(registry.specs_for(op)) + 1 + use_compile  # auto, each impl, eager, compile
    return contenders * (1 if op.writes else 2)


def device_slug(name: str) -> str:
    """A short file-name tag for a device: ``NVIDIA H200`` -> ``h200``, ``cpu`` -> ``cpu``.

    >>> device_slug("NVIDIA H200"), device_slug("NVIDIA GeForce RTX 4090")
    ('h200', 'rtx-4090')
    """
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w and w not in ("nvidia", "geforce", "tesla")]
    return "-".join(words[:2]) or "gpu"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("op", nargs="*", help="ops to measure (default: all)")
    p.add_argument("--ops", default="", help="comma-separated ops (same as the positional list)")
    p.add_argument(
        "--out",
        default=os.environ.get("OUT", "results"),
        help="directory for <device>-<date>-<graph|call>.json/.csv (and .png) (default: $OUT, else ./results)",
    )
    p.add_argument("--no-compile", action="store_true", help="leave out the torch.compile rows")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"), help="the inputs' dtype (default: bfloat16)")
    p.add_argument("--graph", action="store_true", help="time CUDA-graph replays (GPU time without host launch cost)")
    p.add_argument("--sweep", action="store_true", help="add three smaller sizes per op (for the plot)")
    p.add_argument(
        "--plot",
        nargs="?",
        const="",
        default=None,
        metavar="FILE.png",
        help="draw one panel per op: TB/s (TFLOP/s) per provider over sizes, copy bandwidth as a line "
        "(needs the 'plot' extra: matplotlib). Without FILE: next to the JSON in --out",
    )
    p.add_argument("--load", metavar="RESULTS.json", help="no measuring: read a results file (e.g. to --plot it on another machine)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON at the end (tables and progress go to stderr)")


def run_cli(a: argparse.Namespace) -> int:
    from polykernel.core import registry
    from polykernel.tools.console import make_console

    con = getattr(a, "console", None) or make_console(sys.stderr if a.json else None)
    if a.plot is not None:
        from polykernel.tools.plotting import require_matplotlib

        require_matplotlib("polykernel bench --plot")  # before measuring, not after minutes of it
    if a.plot:
        options.writable_file(a.plot, "--plot")
    if a.load:
        _load_conflict(a)
        result = check_result(load(a.load), a.load)
        stem = os.path.splitext(a.load)[0]
        if result.get("complete") is False:
            con.print(f"{a.load}: a run cut before its end ({len(result['rows'])} rows kept)")
    else:
        import torch

        # default: every op of the catalog, the README's first and in their order
        catalog = [op_id.rpartition(".")[2] for op_id in registry.all_op_ids()]
        listed = bench_shapes.SHAPES  # (read there: tests replace the table in bench_shapes)
        names = [*a.op, *(o for o in a.ops.split(",") if o)] or [*listed, *(n for n in catalog if n not in listed)]
        ops = [registry.get_op(o).name for o in names]
        for o in ops:  # an op without shapes: a clear error before the run, not after minutes of it
            shapes_for(o)
        if not torch.cuda.is_available():
            print("polykernel bench needs a CUDA GPU (or --load RESULTS.json to plot saved results)", file=sys.stderr)
            return 2
        options.writable_dir(a.out, "--out")
        header = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
        header["mode"] = "graph" if a.graph else "call"
        stem = os.path.join(a.out, f"{device_slug(header['device'])}-{header['date']}-{header['mode']}")
        # each row goes to <stem>.json as it is measured: a run cut at its time limit keeps them
        out = RowFile(f"{stem}.json", header, echo=lambda line: con.print(line, markup=False, highlight=False))
        try:
            rows, copy = run(ops, not a.no_compile, getattr(torch, a.dtype), a.graph, a.sweep, con, out=out)
        except KeyboardInterrupt:  # the rows so far stay in the file, which says it is incomplete
            raise KeyboardInterrupt(f"{len(out.rows)} row{'s' * (len(out.rows) != 1)} kept in {out.path} (complete: false)") from None
        out.finish(copy_GBps=copy)
        result = {**out.header, "rows": rows}
        _write_csv(rows, stem)
        con.print(f"wrote {stem}.json and {stem}.csv")
    print_rows(result["rows"], con)
    if a.plot is not None:
        from polykernel.tools.plotting import plot_bench

        path = a.plot or f"{stem}.png"
        plot_bench(result, path)
        con.print(f"wrote {path}")
    if a.json:
        print(json.dumps(result["rows"], indent=1))
    return 0


def _load_conflict(a: argparse.Namespace) -> None:
    """An option of a measuring run given with --load is an error (it would be ignored)."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    if name := options.given(a, p, ["op", "ops", "out", "no_compile", "dtype", "graph", "sweep"]):
        raise ValueError(f"--load reads saved rows; {name} applies to a measuring run only")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run_cli(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
