"""What the demo prints: the platform, every op's impls here, and the runs side by side (rich
tables on a terminal, plain text otherwise)."""

from __future__ import annotations

import math
import os
import platform as _platform
import statistics
from typing import TYPE_CHECKING, Any

import torch

from polykernel.tools.console import fits, table

from .runs import TIMED_STEPS

if TYPE_CHECKING:
    from rich.console import Console

    from .runs import DemoResult

__all__ = ["ok_line", "op_table", "print_op_table", "print_platform", "print_result"]

_RUN_NAMES = {
    "torch": "plain PyTorch",
    "polykernel": "polykernel",
    "liger": "Liger-Kernel patch",
    "compile": "torch.compile",
    "polykernel+compile": "polykernel + compile",  # short: the runs tables fit 80 columns
}


def print_platform(con: Console, device: torch.device) -> None:
    import polykernel
    from polykernel.spec import PlatformInfo

    parts = [f"torch {torch.__version__}"]
    try:
        import triton

        parts.append(f"triton {triton.__version__}")
    except ImportError:
        parts.append("triton not installed")
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        parts.append(f"{props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs")
    else:
        parts.append(f"torch using {torch.get_num_threads()} of {os.cpu_count()} CPU threads ({_platform.machine()})")
    con.print(f"polykernel {polykernel.__version__} demo")
    con.print(f"platform: {PlatformInfo.detect(device)} | {' | '.join(parts)} | python {_platform.python_version()}")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        con.print("note: TRITON_INTERPRET=1 is set, so Triton kernels run through the (slow) interpreter on the CPU")


def op_table(device: torch.device, dtype: torch.dtype) -> list[dict[str, Any]]:
    """Every op: each impl's verdict for ``device``/``dtype`` and the auto choice (``explain``)."""
    import polykernel

    rows = []
    for op_id in polykernel.list_ops():
        try:
            e = polykernel.explain(op_id, device=device, dtype=dtype).as_dict()
        except ImportError as exc:
            rows.append({"op": op_id, "chosen": None, "source": None, "impls": [], "missing": f"not in this build ({exc.name or exc})"})
            continue
        except Exception as exc:
            rows.append({"op": op_id, "chosen": None, "source": None, "impls": [], "missing": f"{type(exc).__name__}: {exc}"})
            continue
        rows.append({"op": op_id, "chosen": e["chosen"], "source": e["source"], "impls": e["impls"], "missing": e["error"]})
    return rows


def print_op_table(con: Console, rows: list[dict[str, Any]], device: torch.device, dtype: torch.dtype) -> None:
    """Every op's choice and impls. A reason that keeps impls out of several ops (on a CPU: "needs
    a CUDA device", for every op) is one line under the table, not a cell in each row; where every
    op then makes the same choice, one line says so instead of a row per op."""
    title = f"ops on {device} for {str(dtype).removeprefix('torch.')} (* = the dispatcher's choice; x = cannot run here: why)"
    ops_per_reason: dict[str, set[str]] = {}
    for r in rows:
        for i in r["impls"]:
            if not i["runnable"]:
                ops_per_reason.setdefault(i["reason"], set()).add(r["op"])
    shared = {reason for reason, ops in ops_per_reason.items() if len(ops) > 1}
    cells: dict[str, list[str]] = {}
    for r in rows:
        cells[r["op"]] = [
            f"{i['name']}{'*' if i['name'] == r['chosen'] else ''}" + ("" if i["runnable"] else f" x ({i['reason']})")
            for i in r["impls"]
            if i["runnable"] or i["reason"] not in shared
        ]
    choices = {(r["chosen"], r["source"]) for r in rows}
    if rows and len(choices) == 1 and all(r["impls"] and all("x (" not in c for c in cells[r["op"]]) for r in rows):
        chosen, source = next(iter(choices))
        also: dict[str, int] = {}
        for r in rows:
            for c in cells[r["op"]]:
                if not c.endswith("*"):
                    also[c] = also.get(c, 0) + 1
        con.print(title)
        extra = f"; also runnable: {', '.join(f'{n} ({k} ops)' for n, k in also.items())}" if also else ""
        con.print(f"  every op ({len(rows)}) chooses {chosen} ({source}){extra}")
    else:
        t = table(con, "op", "chosen", "impls", title=title, keep=("op", "chosen"))
        # On a terminal one impl per line (a long reason wraps within its line); plain text keeps
        # each op on one line for grep.
        sep = "\n" if con.is_terminal else "; "
        for r in rows:
            if not r["impls"]:
                t.add_row(r["op"], "-", r["missing"] or "no impl")
                continue
            t.add_row(r["op"], f"{r['chosen']} ({r['source']})" if r["chosen"] else f"none: {r['missing']}", sep.join(cells[r["op"]]))
        con.print(t)
    for reason in sorted(shared, key=lambda why: -len(ops_per_reason[why])):
        names = dict.fromkeys(i["name"] for r in rows for i in r["impls"] if not i["runnable"] and i["reason"] == reason)
        con.print(f"  x {reason} ({len(ops_per_reason[reason])} ops): {', '.join(names)}")


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def print_result(con: Console, res: DemoResult) -> None:
    """The losses per step, the runs table (tokens/s, median step, peak memory, loss difference)
    and the impls polykernel used."""
    base = res.baseline
    n = len(base.losses)
    every = 1 if n <= 40 else math.ceil(n / 30)
    title = f"losses per step (start ~ ln(vocab) = {math.log(res.shape['vocab_size']):.3f} nats; the data's entropy: {res.floor:.3f})"
    t = table(con, "step", *[r.label for r in res.runs], title=title, right=("step", *[r.label for r in res.runs]))
    for i in range(n):
        if i % every == 0 or i == n - 1:
            t.add_row(str(i + 1), *[f"{r.losses[i]:.5f}" if i < len(r.losses) else "" for r in res.runs])
    con.print(t)

    lo, hi = (TIMED_STEPS.start + 1, TIMED_STEPS.stop) if n > TIMED_STEPS.start else (2, n)
    title = f"runs ({'each in its own process' if res.isolated else 'one process'}; tokens/s from the median step time of steps {lo}-{min(hi, n)})"
    for t in _runs_tables(con, res, title):
        con.print(t)
    con.print(f"  losses agree when within {res.tolerance_text} per step ({res.dtype}); memory: {base.memory_kind}")
    for name, why in res.failed.items():
        con.print(f"  FAILED: the {_RUN_NAMES.get(name, name)} run: {why.strip().splitlines()[-1] if why.strip() else '?'}")

    pk = res.run("polykernel")
    if pk is None:
        return
    t = table(con, "op", "impl", "why", title="impls polykernel used in training (polykernel.decisions())", keep=("op", "impl"))
    for r in pk.impls:
        why = r["why"] + (f"; skipped {_skipped_text(r['skipped'])}" if r["skipped"] else "")
        t.add_row(r["op"], r["impl"] + (" (no-grad calls)" if r["forward_only"] else ""), why)
    if pk.impls:
        con.print(t)
    else:
        con.print("impls polykernel used: none recorded")
    if pk.impls and all(r["impl"] == "torch" for r in pk.impls):
        # Nothing but the torch impls ran: polykernel then runs what plain PyTorch runs, and its
        # tokens/s above measure only that (and the dispatch), not its kernels.
        where = (
            "on this CPU every op ran its torch impl (Triton and the GPU kernels need CUDA)"
            if res.device.startswith("cpu")
            else "every op ran its torch impl here (see why above)"
        )
        spread = max((_spread(r.timed) for r in res.runs), default=math.nan)
        within = "" if math.isnan(spread) else f"; step times within one run spread by {spread:.0%} here (interquartile range / median)"
        con.print(
            f"  note: {where}, so every run does the same work and 'vs torch' measures this machine's noise, not polykernel "
            f"(other processes, the clock: a whole run can shift by more than its steps do{within}): "
            "read it as about 1.0x plain PyTorch; run on a GPU for the speedup"
        )


def _spread(times: list[float]) -> float:
    """The interquartile range of ``times`` over their median (nan for fewer than 4)."""
    if len(times) < 4:
        return math.nan
    q1, _, q3 = statistics.quantiles(times, n=4)
    return (q3 - q1) / max(statistics.median(times), 1e-12)


def _skipped_text(skipped: list[str]) -> str:
    """``["triton: needs a CUDA device", "liger: needs a CUDA device"]`` -> ``triton, liger: needs
    a CUDA device`` (the impls with one reason named together, in rank order)."""
    by_reason: dict[str, list[str]] = {}
    for entry in skipped:
        name, _, reason = entry.partition(": ")
        by_reason.setdefault(reason, []).append(name)
    return "; ".join(f"{', '.join(names)}: {reason}" if reason else ", ".join(names) for reason, names in by_reason.items())


def ok_line(res: DemoResult) -> str:
    """The closing line when every run agrees: ``polykernel trains to ...`` (``train`` for several)."""
    names = [_PROSE_NAMES.get(r.label, _RUN_NAMES.get(r.label, r.label)) for r in res.runs[1:]]
    if not names:
        return "ok: plain PyTorch trained (no other run to compare)."
    listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
    return f"ok: {listed} {'trains' if len(names) == 1 else 'train'} to the same losses as plain PyTorch."


_PROSE_NAMES = {"liger": "the Liger-Kernel patch"}


# The runs table's columns: header, right-aligned (a number), and which half it goes to when the
# whole table is too wide for the terminal (0: speed, 1: memory and losses).
_RUN_COLUMNS = (
    ("run", False, 0),
    ("tokens/s", True, 0),
    ("vs torch", True, 0),
    ("median step", True, 0),
    ("1st step", True, 0),
    ("peak memory", True, 1),
    ("vs torch", True, 1),  # the memory ratio
    ("max |loss - torch|", True, 1),
    ("losses", False, 1),
)


def _run_cells(res: DemoResult, r: Any) -> list[str]:
    base = res.baseline
    same = r is base
    return [
        _RUN_NAMES.get(r.label, r.label),
        f"{r.tokens_per_second:,.0f}",
        "" if same else f"{r.tokens_per_second / max(base.tokens_per_second, 1e-9):.2f}x",
        f"{r.median_step_seconds * 1e3:,.1f} ms",
        f"{r.step_seconds[0]:,.1f} s" if r.step_seconds else "",  # includes torch.compile's compile
        _gib(r.peak_bytes),
        "" if same or not base.peak_bytes else f"{r.peak_bytes / base.peak_bytes:.2f}x",
        "" if same else f"{res.max_abs_diff(r):.2e}",
        "baseline" if same else ("agree" if res.agrees(r) else "DIFFER"),
    ]


def _runs_tables(con: Console, res: DemoResult, title: str) -> list[Any]:
    """The runs side by side: one table, or two halves (speed; memory and losses) under one
    title when one table would not fit the terminal without breaking a name or a number."""

    def build(part: int | None, heading: str | None) -> Any:
        cols = [(i, h, num) for i, (h, num, half) in enumerate(_RUN_COLUMNS) if part is None or half == part or i == 0]
        t = table(con, *[h for _, h, _ in cols], title=heading, right=tuple(h for _, h, num in cols if num), keep=("losses",))
        for r in res.runs:
            cells = _run_cells(res, r)
            t.add_row(*[cells[i] for i, _, _ in cols])
        return t

    whole = build(None, title)
    if fits(con, whole):
        return [whole]
    return [build(0, title), build(1, None)]
