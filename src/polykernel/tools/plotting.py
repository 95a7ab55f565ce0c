"""Pictures of results (the optional extra ``plot``: matplotlib, imported only here and lazily).

>>> from polykernel.tools.plotting import plot_bench
>>> plot_bench(json.load(open("benchmarks/results/h200-2026-12-01-graph.json")), "bench.png")  # doctest: +SKIP
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any

__all__ = ["plot_bench", "pyplot", "require_matplotlib"]


def require_matplotlib(what: str) -> None:
    """Raise :class:`~polykernel.errors.MissingExtraError` naming ``what`` and the command that
    installs matplotlib when it is not installed."""
    if importlib.util.find_spec("matplotlib") is None:
        from polykernel.errors import missing_extra

        raise missing_extra(what, "plot")


def pyplot(what: str) -> Any:
    """matplotlib.pyplot on the non-interactive Agg backend (files only; no display needed)."""
    require_matplotlib(what)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# one colour per provider across panels; polykernel's automatic choice drawn thickest
_STYLE = {"polykernel": {"linewidth": 2.6, "zorder": 5}}


def plot_bench(result: dict[str, Any], path: str) -> None:
    """One panel per op: TB/s (TFLOP/s for the fused linear cross-entropy) per provider over the
    sizes measured (the sweep's rows when there are any), forward+backward solid and forward
    dashed, the run's copy bandwidth as a horizontal line."""
    plt = pyplot("polykernel bench --plot")
    rows = [r for r in result["rows"] if not r.get("error") and r.get("size") and math.isfinite(r.get("ms", math.nan))]
    if any(r.get("sweep") for r in rows):
        rows = [r for r in rows if r.get("sweep")]
    ops = list(dict.fromkeys(r["op"] for r in rows))
    if not ops:
        raise ValueError("polykernel bench --plot: no measured rows to plot")
    providers = list(dict.fromkeys(r["impl"] for r in rows))
    colours = {p: plt.get_cmap("tab10")(i % 10) for i, p in enumerate(providers)}
    cols = min(3, len(ops))
    nrows = math.ceil(len(ops) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 3.8 * nrows), squeeze=False)
    copy_tbs = result.get("copy_GBps", 0) / 1e3
    for ax, op in zip(axes.flat, ops):
        flops = any("TFLOP/s" in r for r in rows if r["op"] == op)  # the matmul-bound fused losses
        for provider in providers:
            for mode, dash in (("fwd+bwd", "-"), ("fwd", "--")):
                pts = sorted(
                    (r["size"], r["TFLOP/s"] if flops else r["GB/s"] / 1e3)
                    for r in rows
                    if r["op"] == op and r["impl"] == provider and r["mode"].split()[0] == mode
                )
                if pts:
                    xs, ys = zip(*pts)
                    label = provider if mode == "fwd+bwd" else None
                    ax.plot(xs, ys, dash, marker="o", markersize=3, color=colours[provider], label=label, **_STYLE.get(provider, {}))
        if copy_tbs and not flops:
            ax.axhline(copy_tbs, color="black", linewidth=0.8, linestyle=":", label="2 GiB copy")
        ax.set_xscale("log", base=2)
        ax.set_title(op)
        ax.set_xlabel("GFLOP per forward" if flops else "MiB moved per forward")
        ax.set_ylabel("TFLOP/s" if flops else "TB/s")
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(ops) :]:
        ax.axis("off")
    handles, labels = {}, []
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    labels = list(handles)
    mode = "GPU time (CUDA-graph replays)" if "graph" in str(result.get("mode", "")) else "per call from Python"
    fig.suptitle(f"polykernel bench: {result.get('device', '?')}, {mode}, {result.get('date', '')}; solid fwd+bwd, dashed fwd")
    fig.legend([handles[lab] for lab in labels], labels, loc="lower center", ncol=min(6, len(labels)), frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 0.96))
    fig.savefig(path, dpi=120)
    plt.close(fig)
