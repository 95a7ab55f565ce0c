"""Benchmark rows kept as they are measured, shared by ``polykernel bench`` and the scripts under
``benchmarks/``.

A GPU command runs under a time limit (``timeout``'s SIGTERM, then SIGKILL): a run that wrote its
results only at the end lost every row when it was cut. :class:`RowFile` instead rewrites its JSON
file after each row (to a temporary file, then ``os.replace``: a kill mid-write leaves the previous
version, never half a file) and prints the row at once. The file is one JSON object, ``{**header,
"complete": bool, "rows": [...]}``: ``complete`` stays false until :meth:`RowFile.finish`, so a cut
run's file says so. :func:`announce` prints an estimate of the run time before it starts.

    rows = RowFile(args.json, {"device": name})
    announce(len(cases), per_case_s=20, what="cases", path=args.json)
    for case in cases:
        rows.add(measure(case))          # written and printed now
    rows.finish()
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any


def load(path: str) -> dict[str, Any]:
    """A results file written by ``--json`` (``bench --load``, ``demo --load``); a ``ValueError``
    naming the file and why for one that cannot be read or is not a JSON object."""
    try:
        with open(path) as f:
            result = json.load(f)
    except OSError as exc:
        raise ValueError(f"--load {path}: {exc.strerror or exc}") from None
    except ValueError as exc:  # json.JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"--load {path}: not a results file ({exc})") from None
    if not isinstance(result, dict):
        raise ValueError(f"--load {path}: not a results file (a JSON {type(result).__name__}, not an object)")
    return result


def _print(line: str) -> None:
    print(line, flush=True)  # at once, also when stdout is a pipe or a log file


def _line(row: dict[str, Any]) -> str:
    """A row on one line: its values, floats to 4 significant digits."""
    return "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())


class RowFile:
    """The rows of one run, written to ``path`` (None: printed only) after each :meth:`add`."""

    def __init__(
        self, path: str | os.PathLike[str] | None, header: dict[str, Any] | None = None, *, echo: Callable[[str], Any] | None = None
    ) -> None:
        self.path = os.fspath(path) if path is not None else None
        self.header: dict[str, Any] = dict(header or {})  # may be filled in later (e.g. a rate measured first)
        self.rows: list[dict[str, Any]] = []
        self.echo = echo or _print  # e.g. a rich console's print, above its progress bar
        if self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self._write(complete=False)

    def add(self, row: dict[str, Any], line: str | None = None) -> dict[str, Any]:
        """Keep ``row`` (the file is rewritten now) and print ``line`` (default: the row's values)."""
        self.rows.append(row)
        if self.path:
            self._write(complete=False)
        self.echo(_line(row) if line is None else line)
        return row

    def finish(self, **header: Any) -> None:
        """The run ended: write the file with ``complete`` true (and ``header`` added)."""
        self.header.update(header)
        if self.path:
            self._write(complete=True)
            self.echo(f"wrote {self.path} ({len(self.rows)} rows)")

    def _write(self, complete: bool) -> None:
        assert self.path is not None
        tmp = f"{self.path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({**self.header, "complete": complete, "rows": self.rows}, f, indent=1, default=str)
        os.replace(tmp, self.path)  # atomic: a reader (or a kill) sees the old file or the new one


def read_rows(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A row file as written so far (``complete`` false for a run that was cut)."""
    with open(path) as f:
        return json.load(f)


def announce(
    n: int,
    per_case_s: float,
    what: str = "cases",
    path: str | None = None,
    extra_s: float = 0.0,
    print_: Callable[[str], Any] | None = None,
) -> float:
    """Print (and return) a rough run time: ``n`` × ``per_case_s`` + ``extra_s`` seconds, before measuring."""
    total = n * per_case_s + extra_s
    where = f"; rows kept in {path} as measured" if path else ""
    msg = f"estimate: {n} {what} x ~{per_case_s:.0f} s{f' + {extra_s:.0f} s' if extra_s else ''} = ~{total / 60:.1f} min{where}"
    (print_ or _print)(msg)
    return total
