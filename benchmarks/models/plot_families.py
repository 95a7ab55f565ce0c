"""The families table as one picture: each family's training tokens/s over plain's, per variant
(polykernel, Liger-Kernel, ``torch.compile``), from ``families.py``'s JSON files, the GPU of each
file (its ``gpu.csv``, which ``h200_plan.sh`` writes beside it) named with the family. A family in
several files is drawn from the last one given with its plain row; a later file with some variants
and no plain row (a ``PK_VARIANTS`` rerun) fills in those variants against that plain row, where
its GPU is the same kind.

    python benchmarks/models/plot_families.py --out families.png \\
        benchmarks/results/h200-2026-12-04-third/families-1/families-1.json \\
        benchmarks/results/h100-2026-12-06-nineteenth/families-*/families-*.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

VARIANTS = ("polykernel", "liger", "compile")
COLOURS = {"polykernel": "tab:blue", "liger": "tab:orange", "compile": "tab:green"}


def gpu_of(path: Path) -> str:
    """The GPU named in ``gpu.csv`` beside ``path`` (nvidia-smi's name, shortened), or ``"?"``."""
    csv = path.parent / "gpu.csv"
    if not csv.exists():
        return "?"
    lines = [ln for ln in csv.read_text().splitlines()[1:] if ln.strip()]
    name = lines[0].split(",")[0].strip() if lines else "?"
    return name.removeprefix("NVIDIA ").split()[0]


def speedups(paths: list[Path]) -> dict[str, dict[str, Any]]:
    """Per family (in first-seen order, the last file with its plain row winning): its GPU and
    each variant's tokens/s over plain's (None where the variant failed or did not run); a file
    without the plain row fills in its variants against the kept one on the same kind of GPU."""
    out: dict[str, dict[str, Any]] = {}
    plains: dict[str, float] = {}  # family -> the plain tokens/s its entry is relative to
    for path in paths:
        gpu = gpu_of(path)
        runs: dict[str, dict[str, dict[str, Any]]] = {}
        for r in json.loads(path.read_text())["rows"]:
            runs.setdefault(r["family"], {})[r["variant"]] = r
        for family, by in runs.items():
            ok = {v: by[v]["tokens_per_second"] for v in VARIANTS if v in by and "error" not in by[v]}
            plain = by.get("plain")
            if plain is not None and "error" not in plain:
                plains[family] = plain["tokens_per_second"]
                out[family] = {"gpu": gpu, **{v: None for v in VARIANTS}}
            elif plain is not None or family not in out or out[family]["gpu"] != gpu:
                continue  # (a failed plain row; or nothing to compare with on this kind of GPU)
            out[family].update({v: tps / plains[family] for v, tps in ok.items()})
    return out


def plot(table: dict[str, dict[str, Any]], png: Path, title: str) -> None:
    """Horizontal bars, one group per family, a line at 1.0 (plain)."""
    from polykernel.tools.plotting import pyplot

    plt = pyplot("plot_families.py")
    families = list(table)
    fig, ax = plt.subplots(figsize=(8, 0.42 * len(families) * len(VARIANTS) / 2 + 1.5))
    height = 0.8 / len(VARIANTS)
    for i, variant in enumerate(VARIANTS):
        ys = [k + (i - (len(VARIANTS) - 1) / 2) * height for k in range(len(families))]
        xs = [table[f][variant] or 0.0 for f in families]
        ax.barh(ys, xs, height=height, color=COLOURS[variant], label=variant)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(families)), [f"{f} ({table[f]['gpu']})" for f in families])
    ax.invert_yaxis()
    ax.set_xlabel("training tokens/s over plain PyTorch (no bar: the variant did not run)")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path, help="families.py JSON files (later ones win)")
    parser.add_argument("--out", type=Path, required=True, help="the PNG to write")
    parser.add_argument("--title", default="~1B shapes, 4 x 2048 tokens, bf16, AdamW: speed-up over plain")
    args = parser.parse_args()
    table = speedups(args.files)
    if not table:
        parser.error("no family with a plain row in these files")
    plot(table, args.out, args.title)
    print(f"wrote {args.out} ({len(table)} families)")


if __name__ == "__main__":
    main()
