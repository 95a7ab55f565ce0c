"""How ``polykernel bench`` shows its rows (:mod:`polykernel.tools.bench`): one line per row as it is
measured, the table at the end, and the CSV next to the JSON."""

from __future__ import annotations

import csv
from typing import TYPE_CHECKING, Any

from . import options

if TYPE_CHECKING:
    from rich.console import Console


def _row_line(r: dict[str, Any]) -> str:
    perf = f"{r['TFLOP/s']:.0f} TFLOP/s" if "TFLOP/s" in r else (f"{r['GB/s'] / 1e3:.2f} TB/s" if "GB/s" in r else "")
    return f"{r['op']} {r['shape']} {r['mode']} {r['impl']}: {r['ms']:.3f} ms {perf} {r['error']}".rstrip()


def print_rows(rows: list[dict[str, Any]], console: Console) -> None:
    """The rows as one table: ms, TB/s (or TFLOP/s), % of the copy, peak extra memory, errors."""
    from polykernel.tools.console import table

    t = table(console, "op", "shape", "mode", "impl", "chosen", "ms", "host µs", "TB/s | TFLOP/s", "% copy", "peak+ MiB", "error",
              right=("ms", "host µs", "TB/s | TFLOP/s", "% copy", "peak+ MiB"))  # fmt: skip
    for r in rows:
        perf = f"{r['TFLOP/s']:.0f} TFLOP/s" if "TFLOP/s" in r else (f"{r['GB/s'] / 1e3:.2f}" if "GB/s" in r else "")
        pct = f"{r['% copy']:.1f}" if "% copy" in r else ""
        t.add_row(
            r["op"],
            r["shape"],
            r["mode"],
            r["impl"],
            r.get("chosen", ""),  # rows loaded from older files lack the newer columns
            f"{r['ms']:.3f}",
            _host(r),
            perf,
            pct,
            f"{r.get('peak_extra_MiB', float('nan')):.0f}",
            r.get("error", ""),
        )
    console.print(t)


# What every row of a results file has (the other columns came later, or only for some ops).
_REQUIRED = ("op", "shape", "mode", "impl", "ms")


def check_result(result: dict[str, Any], path: str) -> dict[str, Any]:
    """``result`` (a loaded ``--load`` file) when it holds bench rows; else a ``ValueError``
    naming the file and what is missing (another tool's JSON, a file with no rows)."""
    return options.records(result, "rows", _REQUIRED, path, "a bench results file")


def _host(row: dict[str, Any]) -> str:
    host = row.get("host_us", float("nan"))  # rows loaded from older files lack it
    return "" if host != host else f"{host:.1f}"


def _write_csv(rows: list[dict[str, Any]], stem: str) -> None:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(f"{stem}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
