"""The README's H200 table from a ``polykernel bench`` results file (markdown on stdout).

    python benchmarks/readme_table.py benchmarks/results/h200-2026-11-30-graph.json           # README shapes
    python benchmarks/readme_table.py benchmarks/results/h200-2026-11-30-graph.json --sweep   # + the sweep's sizes

One row per (op, shape, mode); one column per contender: polykernel's automatic choice (with the
impl it chose), each registered impl forced, torch.compile of the reference and the plain eager
reference. Cells are TB/s over the op's ``bytes_moved`` (TFLOP/s and ms for the fused linear
cross-entropy); the best per row in bold; "—" where the contender was not measured, "refuses" where
the impl's predicate or capability refused the case.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

COLUMNS = ("polykernel", "triton", "cute_dsl", "quack", "liger", "cutile", "torch", "torch.compile", "eager reference")


def _value(row: dict[str, Any]) -> tuple[float, str] | None:
    """(higher-is-better score, cell text) of one measured row; None if it did not run."""
    if row.get("error"):
        return None
    tf = row.get("TFLOP/s")
    if tf and not math.isnan(tf):
        return tf, f"{row['ms']:.1f} ms, {tf:.0f} TFLOP/s"
    gbps = row.get("GB/s")
    if gbps and not math.isnan(gbps):
        return gbps, f"{gbps / 1e3:.2f}"
    return None


def render(results: dict[str, Any], sweep: bool) -> str:
    readme_shape: dict[str, str] = {}  # the README's shape of an op: the first (largest) its sweep measured
    for row in results["rows"]:
        readme_shape.setdefault(row["op"], row["shape"])
    cases: dict[tuple[str, str, str], dict[str, dict[str, Any]]] = {}
    for row in results["rows"]:
        if row.get("sweep") and not sweep and row["shape"] != readme_shape[row["op"]]:
            continue
        key = (row["op"], row["shape"], row["mode"].replace(" graph", "").replace(" call", ""))
        cases.setdefault(key, {})[row["impl"].removeprefix("polykernel:")] = row
    present = [c for c in COLUMNS if any(c in v for v in cases.values())]
    head = ["op", "shape", "mode", *[("polykernel (chose)" if c == "polykernel" else c) for c in present]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (op, shape, mode), by_impl in cases.items():
        scored = {c: _value(r) for c, r in by_impl.items()}
        best = max((v[0] for v in scored.values() if v), default=None)
        cells = []
        for c in present:
            r, v = by_impl.get(c), scored.get(c)
            if r is None:
                cells.append("—")
            elif v is None:
                cells.append("refuses" if "NotAvailable" in (r.get("error") or "") else "fails")
            else:
                text = f"**{v[1]}**" if best is not None and v[0] >= best * 0.995 else v[1]
                cells.append(f"{text} ({r['chosen']})" if c == "polykernel" and r.get("chosen") else text)
        lines.append("| " + " | ".join([op, shape, mode, *cells]) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", type=Path, help="a polykernel bench --out JSON file")
    p.add_argument("--sweep", action="store_true", help="every size of the sweep, not only the README shapes")
    a = p.parse_args()
    data = json.loads(a.results.read_text())
    print(
        f"<!-- {a.results.name}: {data.get('device')}, torch {data.get('torch')}, {data.get('date')}, copy {data.get('copy_GBps', 0):.0f} GB/s -->"
    )
    print(render(data, a.sweep))


if __name__ == "__main__":
    main()
