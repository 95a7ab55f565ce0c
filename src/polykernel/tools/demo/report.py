"""What the demo prints: the platform, every op's impls here, and the runs side by side (rich
tables on a terminal, plain text otherwise)."""

from __future__ import annotations

import math
import os
import platform as _platform
from typing import TYPE_CHECKING, Any

import torch

from polykernel.tools.console import table

from .runs import TIMED_STEPS

if TYPE_CHECKING:
    from rich.console import Console

    from .runs import DemoResult

__all__ = ["op_table", "print_op_table", "print_platform", "print_result"]

_RUN_NAMES = {
    "torch": "plain PyTorch",
    "polykernel": "polykernel",
    "liger": "Liger-Kernel patch",
    "compile": "torch.compile",
    "polykernel+compile": "polykernel + torch.compile",
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
    title = f"ops on {device} for {str(dtype).removeprefix('torch.')} (* = the dispatcher's choice; x = cannot run here: why)"
    t = table(con, "op", "chosen", "impls", title=title)
    for r in rows:
        if not r["impls"]:
            t.add_row(r["op"], "-", r["missing"] or "no impl")
            continue
        impls = []
        for i in r["impls"]:
            mark = "*" if i["name"] == r["chosen"] else ("" if i["runnable"] else " x")
            impls.append(f"{i['name']}{mark}" + (f" ({i['reason']})" if not i["runnable"] else ""))
        t.add_row(r["op"], f"{r['chosen']} ({r['source']})" if r["chosen"] else f"none: {r['missing']}", "; ".join(impls))
    con.print(t)


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def print_result(con: Console, res: DemoResult) -> None:
    """The losses per step, the runs table (tokens/s, median step, peak memory, loss difference)
    and the impls polykernel used."""
    base = res.baseline
    n = len(base.losses)
    every = 1 if n <= 40 else math.ceil(n / 30)
    title = (
        f"losses per step (entropy floor of the data: {res.floor:.3f} nats; start ~ ln(vocab) = {math.log(res.shape['vocab_size']):.3f})"
    )
    t = table(con, "step", *[r.label for r in res.runs], title=title, right=("step", *[r.label for r in res.runs]))
    for i in range(n):
        if i % every == 0 or i == n - 1:
            t.add_row(str(i + 1), *[f"{r.losses[i]:.5f}" if i < len(r.losses) else "" for r in res.runs])
    con.print(t)

    lo, hi = (TIMED_STEPS.start + 1, TIMED_STEPS.stop) if n > TIMED_STEPS.start else (2, n)
    t = table(
        con, "run", "tokens/s", "vs torch", "median step", "1st step", "peak memory", "vs torch", "max |loss - torch|", "losses",
        title=f"runs ({'each in its own process' if res.isolated else 'one process'}; tokens/s from the median step time of steps {lo}-{min(hi, n)})",
        right=("tokens/s", "vs torch", "median step", "1st step", "peak memory", "vs torch", "max |loss - torch|"),
    )  # fmt: skip
    for r in res.runs:
        same = r is base
        t.add_row(
            _RUN_NAMES.get(r.label, r.label),
            f"{r.tokens_per_second:,.0f}",
            "" if same else f"{r.tokens_per_second / max(base.tokens_per_second, 1e-9):.2f}x",
            f"{r.median_step_seconds * 1e3:,.1f} ms",
            f"{r.step_seconds[0]:,.1f} s" if r.step_seconds else "",  # includes torch.compile's compile
            _gib(r.peak_bytes),
            "" if same or not base.peak_bytes else f"{r.peak_bytes / base.peak_bytes:.2f}x",
            "" if same else f"{res.max_abs_diff(r):.2e}",
            "baseline" if same else ("agree" if res.agrees(r) else "DIFFER"),
        )
    con.print(t)
    con.print(f"  losses agree when within {res.tolerance_text} per step ({res.dtype}); memory: {base.memory_kind}")
    for name, why in res.failed.items():
        con.print(f"  FAILED: the {_RUN_NAMES.get(name, name)} run: {why.strip().splitlines()[-1] if why.strip() else '?'}")

    pk = res.run("polykernel")
    if pk is None:
        return
    t = table(con, "op", "impl", "why", title="impls polykernel used in training (polykernel.decisions())")
    for r in pk.impls:
        why = r["why"] + (f"; skipped {', '.join(r['skipped'])}" if r["skipped"] else "")
        t.add_row(r["op"], r["impl"] + (" (no-grad calls)" if r["forward_only"] else ""), why)
    if pk.impls:
        con.print(t)
    else:
        con.print("impls polykernel used: none recorded")
