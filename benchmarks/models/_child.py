"""One benchmark variant per fresh Python process (its own allocator, compile caches and env),
its record read back from a ``RESULT {json}`` line on stdout. Shared by compile_llama.py and
compile_saved.py (scripts in this folder import it by name)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

_PREFIX = "RESULT "


def parse(parser: argparse.ArgumentParser, child: Callable[[argparse.Namespace], dict[str, Any]]) -> argparse.Namespace | None:
    """The command line of a script with variants in child processes. With ``--child=NAME`` (what
    :func:`run_child` passes) run ``child(args)`` here, print its record and return None; else
    return the parent's arguments, ``--out`` required."""
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        emit(child(args))
        return None
    if args.out is None:
        parser.error("--out DIR is required")
    return args


def emit(record: dict[str, Any]) -> None:
    """The child's side: print its record for :func:`run_child`."""
    print(_PREFIX + json.dumps(record), flush=True)


def run_child(script: str, name: str, argv: list[str], timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``script --child=name *argv`` and return its record, or ``{"variant", "error"}``."""
    try:
        proc = subprocess.run(
            [sys.executable, script, f"--child={name}", *argv],
            capture_output=True, text=True, timeout=timeout, env=env if env is not None else os.environ.copy(),
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"variant": name, "error": f"timed out after {timeout} s"}
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(_PREFIX)), None)
    return json.loads(line[len(_PREFIX) :]) if line else {"variant": name, "error": (proc.stderr or proc.stdout)[-3000:]}


def last_error_line(record: dict[str, Any]) -> str:
    """The last line of a failed record's error, for a one-line summary."""
    text = record["error"].strip()
    return text.splitlines()[-1] if text else "?"
