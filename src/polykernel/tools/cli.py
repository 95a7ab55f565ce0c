"""Command line: ``polykernel list | explain OP | check [OP] | bench [OP] | tune OP... | env | demo`` (also ``python -m polykernel``).

$ polykernel list                      # every op, its impls and their verdict here
$ polykernel explain rms_norm --dtype bfloat16 --shape 4096x4096
$ polykernel check rms_norm --json     # parity of every runnable impl with the reference
$ polykernel env                       # versions, devices, settings
$ polykernel tune rms_norm --shapes 4096x4096 --dtype bfloat16   # fill the tuning store ahead of time
$ polykernel demo                      # the main job (see polykernel.tools.demo)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform as _platform
import sys
from typing import TYPE_CHECKING, Any

from polykernel.tools import options
from polykernel.tools.console import make_console, progress, table

if TYPE_CHECKING:
    from rich.console import Console

_DTYPES = ("float32", "bfloat16", "float16", "float64")
_DEVICE_HELP = "cpu, cuda or cuda:N (default: cuda where torch sees a GPU, else cpu)"


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _device(args: argparse.Namespace) -> str:
    """``--device``, else the default; one this machine does not have is an error (options.device)."""
    return options.device(args.device) if args.device else _default_device()


def _dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def _console(args: argparse.Namespace) -> Console:
    """The console given to main(), else stdout's; with --json, stderr's (stdout is the JSON)."""
    return getattr(args, "console", None) or make_console(sys.stderr if getattr(args, "json", False) else None)


def cmd_list(args: argparse.Namespace) -> int:
    import polykernel

    device = _device(args)
    rows = []
    for op_id in polykernel.list_ops():
        e = polykernel.explain(op_id, device=device, dtype=_dtype(args.dtype))
        rows.append(e.as_dict())
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    con = _console(args)
    title = f"ops and impls on {rows[0]['platform'] if rows else device} ({args.dtype})"
    t = table(con, "op", "chosen", "impls (why not runnable)", title=title, keep=("op", "chosen"))
    for r in rows:
        cells = [impl["name"] + ("" if impl["runnable"] else f" (no: {impl['reason']})") for impl in r["impls"]]
        t.add_row(r["op"], r["chosen"] or f"none: {r['error']}", ", ".join(cells))
    con.print(t)
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    import polykernel
    from polykernel.core import registry

    device = _device(args)
    dtype = _dtype(args.dtype)
    known = sorted(registry.specs_for(registry.get_op(args.op)))
    if args.impl is not None and args.impl not in known:  # a typo, not an impl that cannot run here (explained below)
        raise ValueError(f"--impl {args.impl!r}: {registry.get_op(args.op).id} has no such impl; its impls are: {', '.join(known)}")
    if args.shape:
        case = options.example(registry.get_op(args.op), args.shape, dtype, device, args.grad)
        e = polykernel.explain(args.op, *case.args, impl=args.impl, **case.kwargs)
    else:
        e = polykernel.explain(args.op, device=device, dtype=dtype, impl=args.impl, needs_grad=args.grad)
    if args.json:
        print(json.dumps(e.as_dict(), indent=2))
        return 0 if e.chosen else 1
    d = e.as_dict()
    con = _console(args)
    con.print(f"{d['op']} on {d['platform']}")
    con.print("  arguments: " + ", ".join(f"{k}={v}" for k, v in d["arg_class"].items()))
    con.print(f"  chosen: {d['chosen']} (source: {d['source']})" if d["chosen"] else f"  chosen: none ({d['error']})")
    t = table(con, "", "impl", "rank", "verdict", right=("rank",), keep=("", "impl"))
    for r in d["impls"]:
        t.add_row("*" if r["name"] == d["chosen"] else "", r["name"], str(r["rank"]), "runnable" if r["runnable"] else f"no: {r['reason']}")
    con.print(t)
    for module, err in d["import_errors"].items():
        con.print(f"  ! module {module} failed to import: {err}")
    if d["tuned"]:
        t = table(con, "impl", "gpu ms", "host/wall ms", "error", title="measured (tuning)", right=("gpu ms", "host/wall ms"))
        for name, tm in d["tuned"].get("times", {}).items():
            gpu = tm.get("gpu_ms")
            t.add_row(name, "" if gpu is None else f"{gpu:.4g}", f"{tm.get('host_ms', float('nan')):.4g}", tm.get("error") or "")
        con.print(t)
    return 0 if e.chosen else 1


def cmd_check(args: argparse.Namespace) -> int:
    from polykernel.testing import check_parity

    device = _device(args)
    dtypes = [_dtype(args.dtype)] if args.dtype else None
    con = _console(args)
    plan = _check_plan(args.op, args.impl)
    if not isinstance(plan, str) and args.dtype:
        plan = _check_dtype(plan, args.dtype, args.op is not None)
    if isinstance(plan, str):  # a name no op (or not the op asked for) has, a dtype it lacks: one line, nothing runs
        print(f"polykernel check: {plan}", file=sys.stderr)
        return 2
    results = []
    with progress(con, transient=True) as bar:
        task = bar.add_task("parity", total=len(plan))
        for op, names in plan.items():
            bar.update(task, description=f"parity {op}")
            results += check_parity(op, names, device=device, dtypes=dtypes, large=args.large)
            bar.advance(task)
    skipped = [r for r in results if r.skipped]
    failed = [r for r in results if not r.ok and not r.skipped]
    # An impl asked for that could run none of its cases is an error; one that its predicate
    # kept off some cases (as auto selection would) is reported, not failed.
    ran = {(r.op, r.impl) for r in results if not r.skipped}
    unavailable = {(r.op, r.impl) for r in skipped} - ran
    status = 1 if failed or unavailable else 0
    if args.json:
        print(json.dumps([r.__dict__ for r in results], indent=2, default=str))
        return status
    shown = [r for r in results if not r.skipped] if args.verbose else failed
    if shown:
        t = table(
            con, "", "op", "impl", "case", "dtype", "fwd err/tol", "bwd err/tol", "message",
            right=("fwd err/tol", "bwd err/tol"), keep=("", "op", "impl", "dtype"),
        )  # fmt: skip
        for r in shown:
            t.add_row(
                "ok" if r.ok else "FAIL", r.op, r.impl, r.case, r.dtype, f"{r.forward_error:.3g}", f"{r.backward_error:.3g}", r.message
            )
        con.print(t)
        con.print(f"  {_ERR_UNITS}")
    for line in _not_run_lines(skipped, results, unavailable):
        con.print(line)
    con.print(_checked_line(results))
    passed = len(results) - len(failed) - len(skipped)
    con.print(f"{passed} passed, {len(failed)} failed" + (f", {len(skipped)} not run" if skipped else ""))
    return status


# What check's error columns measure (the table's note and --verbose's help).
_ERR_UNITS = (
    "err/tol: the largest |impl - ref| / (atol + rtol·|ref|) over the output (fwd) and the input gradients (bwd), "
    "ref the op's reference in float64, atol and rtol the op's error model for the dtype: a multiple of the tolerance, <= 1 passes"
)


def _checked_line(results: list[Any]) -> str:
    """Which impls ran, on how many ops and cases (check never names them otherwise)."""
    ops: dict[str, set[str]] = {}
    cases: dict[str, int] = {}
    for r in results:
        if not r.skipped:
            ops.setdefault(r.impl, set()).add(r.op)
            cases[r.impl] = cases.get(r.impl, 0) + 1
    if not ops:
        return "checked: no impl ran"
    parts = [f"{impl} ({len(ops[impl])} op{'s' * (len(ops[impl]) != 1)}, {cases[impl]} cases)" for impl in sorted(ops)]
    return "checked: " + ", ".join(parts)


def _check_plan(op: str | None, impls: list[str] | None) -> dict[str, list[str] | None] | str:
    """Op id -> the impls to check (None: every runnable one), or the error line for a name that
    the op (or, without an op, every op) lacks. Without an op, ops that lack a name skip it."""
    import polykernel
    from polykernel.core import registry

    if op is not None:
        the_op = registry.get_op(op)
        valid = sorted(registry.specs_for(the_op))
        unknown = [n for n in impls or () if n not in valid]
        if unknown:
            return f"{the_op.id} has no impl {unknown[0]!r}; its impls are: {', '.join(valid)}"
        return {the_op.id: impls or None}
    plan: dict[str, list[str] | None] = {}
    union: set[str] = set()
    for op_id in polykernel.list_ops():
        valid = registry.specs_for(op_id)
        union.update(valid)
        names = [n for n in impls or () if n in valid]
        if names or not impls:
            plan[op_id] = names or None
    unknown = [n for n in impls or () if n not in union]
    if unknown:
        return f"no op has an impl {unknown[0]!r}; the ops' impls are: {', '.join(sorted(union))}"
    return plan


def _check_dtype(plan: dict[str, list[str] | None], dtype: str, named: bool) -> dict[str, list[str] | None] | str:
    """The plan without the ops not declared for ``dtype`` (their cases and tolerances are not
    defined there: a check would report false failures), or the error line when none is left."""
    from polykernel.core import registry

    kept = {op: names for op, names in plan.items() if _dtype(dtype) in registry.get_op(op).dtypes}
    if kept:
        return kept
    if named:
        (op,) = plan
        declared = ", ".join(str(d).removeprefix("torch.") for d in registry.get_op(op).dtypes)
        return f"--dtype {dtype}: {op} is checked in {declared}"
    return f"--dtype {dtype}: no op is checked in {dtype}"


def _not_run_lines(skipped: list[Any], results: list[Any], unavailable: set[tuple[str, str]]) -> list[str]:
    """One line per (op, impl) that did not run some cases, with the reasons (not a failure row each)."""
    groups: dict[tuple[str, str], list[Any]] = {}
    for r in skipped:
        groups.setdefault((r.op, r.impl), []).append(r)
    lines = []
    for (op, impl), rows in groups.items():
        reasons = "; ".join(dict.fromkeys(r.skipped for r in rows))
        total = sum(1 for r in results if (r.op, r.impl) == (op, impl))
        if (op, impl) in unavailable:
            lines.append(f"{op}: impl {impl!r} is not available here: {reasons} ({total} cases not run)")
        else:
            lines.append(f"{op}: impl {impl!r} did not run {len(rows)} of {total} cases: {reasons}")
    return lines


def cmd_bench(args: argparse.Namespace) -> int:
    from polykernel.tools import bench

    return bench.run_cli(args)


def cmd_tune(args: argparse.Namespace) -> int:
    from polykernel.tools import tune_cmd

    return tune_cmd.run_cli(args)


def cmd_env(args: argparse.Namespace) -> int:
    info: dict[str, Any] = {"python": sys.version.split()[0], "platform": _platform.platform()}
    import polykernel

    info["polykernel"] = polykernel.__version__
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda
        info["devices"] = [
            f"cuda:{i} {torch.cuda.get_device_name(i)} sm_{''.join(map(str, torch.cuda.get_device_capability(i)))}"
            for i in range(torch.cuda.device_count())
        ] or ["cpu only"]
    except ImportError:
        info["torch"] = "not installed"
    for module in _ENV_MODULES:
        info[module] = _module_status(module)
    info["native launch path"] = _native_status()
    info["settings"] = {k: v for k, v in os.environ.items() if k.startswith("POLYKERNEL_") or k == "TRITON_INTERPRET"}
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    con = _console(args)
    t = table(con, "", "", title="polykernel env", show_header=False)
    for k, v in info.items():
        t.add_row(
            k,
            ", ".join(v)
            if isinstance(v, list)
            else (" ".join(f"{a}={b}" for a, b in v.items()) or "(none)")
            if isinstance(v, dict)
            else str(v),
        )
    con.print(t)
    return 0


# The optional packages polykernel uses (its extras and the peers it adapts), by import name.
_ENV_MODULES = ("triton", "cutlass", "cuda.tile", "liger_kernel", "quack", "flashinfer", "sgl_kernel", "transformers", "trl")


def _module_status(module: str) -> str:
    """Its version, "not installed", or the version and why it fails to import: a broken install
    (a missing CUDA library, an incompatible torch) is what env is for, so it must not end env."""
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # no parent package (cuda.tile without cuda)
        found = False
    except Exception as exc:  # a parent package that raises on import
        return f"import fails: {_why(exc)}"
    if not found:
        return "not installed"
    try:
        importlib.import_module(module)
    except Exception as exc:
        return f"{_version(module)}, import fails: {_why(exc)}"
    return _version(module)


def _why(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[-1]}" if text else type(exc).__name__


def _native_status() -> str:
    """Whether the native launch path is built for this torch/Python/source (never builds it)."""
    try:
        from polykernel.backends.triton import _native

        mode = _native.mode()
        built = _native._built()
    except Exception as exc:  # no triton, a bad POLYKERNEL_NATIVE
        return f"unavailable ({_why(exc)})"
    where = f"built ({_native.build_dir()})" if built else "not built (python -m polykernel.backends.triton._native builds it)"
    return f"{where}, POLYKERNEL_NATIVE={mode}"


def _version(module: str) -> str:
    from importlib import metadata

    dist = {
        "cutlass": "nvidia-cutlass-dsl",
        "cuda.tile": "cuda-tile",
        "liger_kernel": "liger-kernel",
        "quack": "quack-kernels",
        "flashinfer": "flashinfer-python",
        "sgl_kernel": "sgl-kernel",
    }.get(module, module)
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "installed"


def cmd_demo(args: argparse.Namespace, rest: list[str]) -> int:
    from polykernel.tools import demo

    return demo.main(rest, console=getattr(args, "console", None))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="polykernel", description="LLM kernels with per-call, per-device impl selection")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("list", help="every op with its impls and their verdict on this machine")
    s.add_argument("--device", help=_DEVICE_HELP)
    s.add_argument("--dtype", default="bfloat16", choices=_DTYPES, help="the inputs' dtype (default: bfloat16)")
    s.add_argument("--json", action="store_true", help="print the verdicts as JSON")

    s = sub.add_parser("explain", help="which impl would run for an op, and why")
    s.add_argument("op", help="an op id or bare name (rms_norm, norm.rms_norm; polykernel list shows them)")
    s.add_argument("--device", help=_DEVICE_HELP)
    s.add_argument("--dtype", default="bfloat16", choices=_DTYPES, help="the inputs' dtype (default: bfloat16)")
    s.add_argument(
        "--shape",
        type=options.shape,
        help="sizes of the op's example inputs (random), in the op's layout: x's shape for a norm or activation (e.g. 4096x4096), "
        "NxHxV for fused_linear_cross_entropy, 2BxTxHxV for the pairwise losses (dpo, orpo, cpo, simpo), BxTxHxV for kto and grpo; "
        "a shape that does not fit says the op's layout",
    )
    s.add_argument("--grad", action="store_true", help="the call's inputs require grad (explains fwd+bwd)")
    s.add_argument("--impl", help="explain a forced impl (as impl= would)")
    s.add_argument("--json", action="store_true", help="print the explanation as JSON")

    s = sub.add_parser("check", help="parity of every runnable impl with the op's reference, forward and backward")
    s.add_argument("op", nargs="?", help="an op id or bare name (default: every op)")
    s.add_argument("--impl", action="append", help="only this impl (repeatable)")
    s.add_argument("--device", help=_DEVICE_HELP)
    s.add_argument("--dtype", choices=_DTYPES, help="only this dtype (default: each of the op's dtypes: float32, bfloat16, float16)")
    s.add_argument("--large", action="store_true", help="add the full-size cases (GPU)")
    s.add_argument("--verbose", "-v", action="store_true", help="every case, with its errors; " + _ERR_UNITS.replace("%", "%%"))
    s.add_argument("--json", action="store_true", help="print every case's result as JSON")

    from polykernel.tools import bench as _bench  # argparse only; torch loads when a command runs

    s = sub.add_parser("bench", help="impls next to eager PyTorch, torch.compile and installed peers (CUDA)")
    _bench.add_arguments(s)

    from polykernel.tools import tune_cmd as _tune  # argparse only

    s = sub.add_parser("tune", help="measure impls for given ops and shapes and store the choices (the tuning store)")
    _tune.add_arguments(s)

    s = sub.add_parser("env", help="versions, devices and settings")
    s.add_argument("--json", action="store_true", help="print them as JSON")

    sub.add_parser("demo", help="train a small Llama with and without polykernel, side by side (polykernel demo --help)", add_help=False)
    return p


def main(argv: list[str] | None = None, *, console: Console | None = None) -> int:
    """Run one command; its exit status. ``console``: where tables and progress go (default: a
    rich console on stdout, plain when stdout is not a terminal); ``--json`` always prints to stdout.

    >>> main(["list", "--device", "cpu", "--json"])  # doctest: +SKIP
    0
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "demo":
        return _interruptible("demo", lambda: cmd_demo(argparse.Namespace(console=console), argv[1:]))
    args = build_parser().parse_args(argv)
    args.console = console
    handler = {"list": cmd_list, "explain": cmd_explain, "check": cmd_check, "bench": cmd_bench, "tune": cmd_tune, "env": cmd_env}[
        args.command
    ]
    try:
        return _interruptible(args.command, lambda: handler(args))
    except Exception as exc:  # polykernel's own errors read well without a traceback
        from polykernel.errors import PolykernelError

        if isinstance(exc, (PolykernelError, ValueError)):
            print(f"polykernel {args.command}: {exc}", file=sys.stderr)
            return 2
        raise


def _interruptible(command: str, run: Any) -> int:
    """``run()``; Ctrl-C ends it with one line and status 130 (128 + SIGINT), as a shell reports
    it. What a command measured so far stays where it was written (bench's rows, with
    "complete": false; tune's decisions, in the tuning store)."""
    try:
        return run()
    except KeyboardInterrupt as exc:  # its message, if any, says what was kept
        print(f"polykernel {command}: interrupted" + (f"; {exc}" if str(exc) else ""), file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
