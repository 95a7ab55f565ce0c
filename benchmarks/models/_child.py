"""One benchmark variant per fresh Python process (its own allocator, compile caches and env),
its record read back from a ``RESULT {json}`` line on stdout. Shared by the model benchmarks
that run variants (scripts in this folder import it by name)."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from polykernel.tools.rows import RowFile, announce

_PREFIX = "RESULT "
_PROGRESS = re.compile(r"\d+%\|")  # a tqdm bar


def parse(
    parser: argparse.ArgumentParser,
    child: Callable[[argparse.Namespace], dict[str, Any]],
    *,
    required: str | None = "--out DIR",
    prepare: Callable[[argparse.Namespace], None] | None = None,
) -> argparse.Namespace | None:
    """The command line of a script with variants in child processes. With ``--child=NAME`` (what
    :func:`run_child` passes) run ``child(args)`` here, print its record and return None; else
    return the parent's arguments, the option ``required`` names (``"--out DIR"``: ``args.out``)
    required, if any. ``prepare(args)`` runs first in both (e.g. ``--tiny``'s sizes)."""
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if prepare is not None:
        prepare(args)
    if args.child:
        emit(child(args))
        return None
    if required is not None and getattr(args, required.split()[0].lstrip("-").replace("-", "_")) is None:
        parser.error(f"{required} is required")
    return args


def emit(record: dict[str, Any]) -> None:
    """The child's side: print its record for :func:`run_child`."""
    print(_PREFIX + json.dumps(record), flush=True)


def run_child(script: str, name: str, argv: list[str], timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``script --child=name *argv`` and return its record, or ``{"variant", "error"}``; either
    with ``wall_s``, the process's seconds from start to end (imports, builds and compiles included:
    what a plan's part must leave room for)."""
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, script, f"--child={name}", *argv],
            capture_output=True, text=True, timeout=timeout, env=env if env is not None else os.environ.copy(),
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"variant": name, "error": f"timed out after {timeout} s", "wall_s": round(time.perf_counter() - start, 1)}
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(_PREFIX)), None)
    record = json.loads(line[len(_PREFIX) :]) if line else {"variant": name, "error": (proc.stderr or proc.stdout)[-3000:]}
    record["wall_s"] = round(time.perf_counter() - start, 1)
    return record


def run_all(
    script: str,
    names: list[str],
    argv: list[str],
    timeout: float,
    summary: Callable[[dict[str, Any]], str],
    width: int,
    failed: str = "error",
    out: RowFile | None = None,
    per_variant_s: float = 60.0,
) -> list[dict[str, Any]]:
    """Each variant through :func:`run_child`, in order, a line printed per variant as it ends
    (``NAME  summary(record)``, or ``NAME  {failed}: <its error's last line>``); the records.
    With ``out`` each record is also written to its file as it ends (a run cut at a time limit
    keeps them), after an estimate of ``per_variant_s`` a variant."""
    if out is not None:
        announce(len(names), per_variant_s, what="variants", path=out.path)
    records = []
    for name in names:
        record = run_child(script, name, argv, timeout)
        records.append(record)
        line = f"{name:{width}} {f'{failed}: {last_error_line(record)}' if 'error' in record else summary(record)}"
        if out is not None:
            out.add(record, line)
        else:
            print(line, flush=True)
    return records


def last_error_line(record: dict[str, Any]) -> str:
    """The last line of a failed record's error, for a one-line summary: progress bars (tqdm's
    ``  0%|...| 0/3``, which a trainer prints after the traceback) are passed over."""
    lines = [ln for ln in record["error"].splitlines() if ln.strip() and not _PROGRESS.search(ln)]
    return lines[-1].strip() if lines else "?"
