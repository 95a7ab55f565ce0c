"""``polykernel demo --plot FILE.png``: loss per step for every run, and tokens/s per run."""

from __future__ import annotations

from typing import Any

from polykernel.tools import options
from polykernel.tools.plotting import pyplot

__all__ = ["check_result", "plot_demo"]


def check_result(result: dict[str, Any], path: str) -> dict[str, Any]:
    """``result`` (a loaded ``--load`` file) when it is a demo result (what :func:`plot_demo`
    reads); else a ``ValueError`` naming the file and what is missing."""
    if isinstance(result.get("runs"), list) and result["runs"] and "entropy_floor" not in result:
        raise ValueError(f"--load {path}: not a demo result (no 'entropy_floor')")
    return options.records(result, "runs", ("label", "losses", "tokens_per_second"), path, "a demo result")


def plot_demo(result: dict[str, Any], path: str) -> None:
    """Two panels from a demo result (``DemoResult.as_dict()``): the loss per step of every run
    (the data's entropy floor dashed), and tokens/s per run as bars labelled with the ratio to
    plain PyTorch.

    >>> plot_demo(json.load(open("demo.json")), "demo.png")  # doctest: +SKIP
    """
    plt = pyplot("polykernel demo --plot")
    runs = result["runs"]
    fig, (ax_loss, ax_tps) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [1.6, 1]})
    colours = {r["label"]: plt.get_cmap("tab10")(i % 10) for i, r in enumerate(runs)}
    for r in runs:
        ax_loss.plot(range(1, len(r["losses"]) + 1), r["losses"], label=r["label"], color=colours[r["label"]], linewidth=1.4)
    ax_loss.axhline(result["entropy_floor"], color="black", linestyle=":", linewidth=0.8, label="entropy floor of the data")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("training loss (nats)")
    ax_loss.set_title("loss per step (same data, seed and initial weights)")
    ax_loss.legend(frameon=False)
    ax_loss.grid(True, alpha=0.3)

    base = runs[0]["tokens_per_second"] or 1.0
    labels = [r["label"] for r in runs]
    values = [r["tokens_per_second"] for r in runs]
    bars = ax_tps.bar(labels, values, color=[colours[lab] for lab in labels])
    for bar, v in zip(bars, values):
        ax_tps.annotate(f"{v / base:.2f}x", (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom", fontsize=9)
    if len(labels) > 4:  # long names ("polykernel+compile") would overlap their neighbours
        ax_tps.tick_params(axis="x", labelrotation=20)
        for tick in ax_tps.get_xticklabels():
            tick.set_horizontalalignment("right")
    ax_tps.set_ylabel("tokens/s (median step)")
    ax_tps.set_title("throughput")
    ax_tps.grid(True, axis="y", alpha=0.3)
    model = result.get("model", {})
    fig.suptitle(
        f"polykernel demo: {model.get('kind', '')} Llama, hidden {model.get('hidden_size')}, {model.get('num_layers')} layers, "
        f"vocab {model.get('vocab_size')}; {result.get('device')} {result.get('dtype')}"
    )
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    fig.savefig(path, dpi=120)
    plt.close(fig)
