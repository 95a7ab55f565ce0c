"""Measured selection across the serving providers: is the tuned choice the fastest at every
point of a decode/prefill sweep? (issue 25)

On the H200 (issue 25's run), with the serving peers staged: ``bash benchmarks/stage_serving_peers.sh``
here packs FlashInfer and sgl-kernel under .gpu/serving/ (one part today; docs/impls.md), then two
device runs right after each other (each well inside the 10-minute limit; the second finds the
peers installed and FlashInfer's JIT cache warm on the same machine):

    # run 1, carrying [".gpu/serving/setup.sh", ".gpu/serving/manifest", ".gpu/serving/parts-1"]:
    bash .gpu/serving/setup.sh && source /opt/pk/serving/env.sh && PYTHONPATH=src python benchmarks/tuning/sweep_serving.py \
        --out $OUT/sweep-serving-1 --ops silu_and_mul gelu_and_mul fused_add_rms_norm_ rotary_embedding_
    # run 2, carrying nothing more:
    source /opt/pk/serving/env.sh && PYTHONPATH=src python benchmarks/tuning/sweep_serving.py \
        --out $OUT/sweep-serving-2 --ops dynamic_quant_fp8 static_quant_fp8 rms_norm_quant_fp8 rms_norm fused_add_rms_norm

All nine ops in one run (drop ``--ops``) is an estimated 5 minutes of measuring (63 points, up
to 11 contenders each at rms_norm) plus the builds on a fresh machine: FlashInfer's JIT modules
(cached on disk for the next run), cuda_jit (built into DIR/cache, so once per run), torch.compile
per op. The files are rewritten after each op, so a run stopped at its limit keeps the ops it
finished (each op's first point's ``tune_s`` says what its builds cost).

On this CPU (tiny sizes, torch, torch_compile and Triton's interpreter; the peers show as not
runnable, with explain's reason), in well under a minute:

    PYTHONPATH=src python benchmarks/tuning/sweep_serving.py --out DIR --smoke

Ops: the serving functions ``silu_and_mul``, ``gelu_and_mul``, ``fused_add_rms_norm_``,
``rotary_embedding_``, ``dynamic_quant_fp8``, ``static_quant_fp8``, ``rms_norm_quant_fp8``, and
the training-layout ``rms_norm`` and ``fused_add_rms_norm`` forward (no gradient). bf16 in (the
quantisers write fp8). Tokens 1, 4, 16, 64 (decode) and 512, 2048, 8192 (prefill) at Llama-8B's
widths, from ``polykernel bench``'s SHAPES (its row length per op) and each op's ``example``
(bench's builder): hidden 4096, the GLUs' x ``[T, 2·14336]``, rotary q ``[T, 32·128]`` and k
``[T, 8·128]`` over a 4096-position cache.

Per point (op, tokens), as ``sweep_tuning.py`` does it (its helpers are imported from there):

- every registered impl that can take the call (``explain``'s verdicts: torch, triton, cuda_jit,
  torch_compile, flashinfer, sgl_kernel where registered), forced with ``impl=``; the others are
  rows with explain's reason;
- the tuned choice: the public call with ``POLYKERNEL_TUNE=on`` and a fresh store (DIR/cache),
  measured and stored by its first call, made on the example's fresh arguments before anything
  else runs on them. The in-process caches are cleared before each point, so that each point is
  measured on its own and first (its timing starts from a fresh decision), as a process meeting
  that size alone would; a tuned decision chooses per size bucket anyway (docs/tuning.md).

Two times per row, each the median of ``ROUNDS`` interleaved rounds:

- ``graph``: GPU time of CUDA-graph replays (``polykernel.tools.bench.measure(graph=True)``,
  ``do_bench(warmup=5, rep=20)``); the tuned row names the store's graph choice;
- ``eager``: per-call time as a serving loop pays it, ``max(GPU time, host time)`` (the tuner's
  cost model): ``bench.measure`` eagerly for the GPU time, ``bench.host_us_per_call`` for the
  host's time to issue one call; the tuned row names the store's eager choice.

Prints per point the fastest impl, the tuned choice, tuned/fastest (the claim: <= 1.05) and the
best peer (flashinfer, sgl_kernel): in graph mode tuned/peer (issue 25: <= 1), in eager mode
tuned - peer in µs (issue 25: <= 2 µs); then a summary line per op and mode. Writes
DIR/sweep_serving.json, .csv and .png (matplotlib if installed: µs against tokens per impl, one
row of panels per op, graph and eager, the tuned call ringed). On the CPU (``--smoke``) both
modes are the same wall-clock time and there are no peers.
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sweep_tuning as st  # this folder's sibling: its helpers (not a package)

from polykernel.tools.rows import RowFile, announce

HOST_HOLD_SHORT = 10_000_000  # GPU cycles (~5 ms on an H200): the eager host timing's hold per round

OPS = (
    "silu_and_mul",
    "gelu_and_mul",
    "fused_add_rms_norm_",
    "rotary_embedding_",
    "dynamic_quant_fp8",
    "static_quant_fp8",
    "rms_norm_quant_fp8",
    "rms_norm",
    "fused_add_rms_norm",
)
TOKENS = (1, 4, 16, 64, 512, 2048, 8192)
SMOKE_TOKENS = (1, 8)
SMOKE_WIDTH = {"silu_and_mul": 128, "gelu_and_mul": 128}  # [T, 2d] with d = 64; the others 64
MODES = ("graph", "eager")
PEERS = ("flashinfer", "sgl_kernel")  # the serving engines' kernels issue 25 measures us against
PEER_EAGER_US = 2.0  # issue 25: eager per-call time <= the peers' + 2 µs
STATIC_CLAIM = 1.02  # issue 34: auto (untuned) within 2% of the fastest provider
CSV_FIELDS = "op mode tokens width shape impl chosen ms us gpu_us host_us TB/s bytes tune_s error".split()


def width(op_name: str, smoke: bool) -> int:
    """The op's row length: ``polykernel bench``'s README shape (Llama-8B's widths), or a tiny one."""
    from polykernel.tools import bench

    return SMOKE_WIDTH.get(op_name, 64) if smoke else bench.SHAPES[op_name][0][1][-1]


def _timers(device: str) -> dict[str, Any]:
    """mode -> fn -> (ms, GPU ms, host µs per call) of the forward (no gradient): ``graph``, the
    replays' GPU time (no host time); ``eager``, max(GPU time, host time) per call."""
    import torch

    if device == "cuda":
        from polykernel.tools import bench

        def graph(fn: Any) -> tuple[float, float | None, float | None]:
            return bench.measure(fn, [], False, graph=True, warmup=5, rep=20)[0], None, None

        def eager(fn: Any) -> tuple[float, float | None, float | None]:
            gpu = bench.measure(fn, [], False, graph=False, warmup=5, rep=20)[0]
            # best of 9 rounds of 5 ms holds (not 3 of 25 ms: same time): the 2026-12-04 fifth run's
            # eager rows at 1-64 tokens spread by up to 50% between the sweep's interleaved rounds
            host = bench.host_us_per_call(bench._step(fn, [], False), rounds=9, hold_cycles=HOST_HOLD_SHORT)
            return max(gpu, host / 1e3), gpu, host

        return {"graph": graph, "eager": eager}

    def cpu(fn: Any) -> tuple[float, float | None, float | None]:  # --smoke: wall clock, both modes
        return st._time_cpu(lambda: torch.no_grad()(fn)()), None, None

    return {"graph": cpu, "eager": cpu}


def _row(base: dict[str, Any], impl: str, mode: str, error: str | None) -> dict[str, Any]:
    return {**base, "impl": impl, "mode": mode, "ms": None, "us": None, "TB/s": None, "error": error}


def sweep(smoke: bool, ops: list[str], tokens: list[int], after_op: Any = None, sink: RowFile | None = None) -> list[dict[str, Any]]:
    """Every row of the sweep; each point's rows go to ``sink`` once timed (a run stopped at its
    time limit keeps them), and ``after_op(rows)`` is called once each op is done."""
    import torch

    import polykernel
    from polykernel.core import registry
    from polykernel.tools import bench

    device = "cpu" if smoke else "cuda"
    timers = _timers(device)
    rows: list[dict[str, Any]] = []
    for op_name in ops:
        op = registry.get_op(op_name)
        public = getattr(polykernel, op.name)
        n = width(op_name, smoke)
        for t in tokens:
            torch.manual_seed(0)
            case = op.example((t, n), torch.bfloat16, device, False)
            args, kwargs = case.args, dict(case.kwargs)
            nbytes = op.bytes_moved(*args, backward=False)
            base = {"op": op_name, "tokens": t, "width": n, "shape": bench._label(op_name, (t, n)), "bytes": nbytes}
            first = len(rows)  # this point's rows start here
            print(f"{op_name} {base['shape']}", file=sys.stderr, flush=True)
            verdicts, static = _verdicts_and_static(op_name, args)
            # The tuned call first, on the example's own arguments (the in-place ops rewrite them
            # on every call after this): measured on clones of them, stored, then run.
            polykernel.clear_caches()
            t0 = time.perf_counter()
            try:
                with torch.no_grad():
                    public(*args, **kwargs)
                tune_error = None
            except Exception as exc:  # reported on the tuned rows; the forced impls still run
                tune_error = _error(exc)
            tune_s = time.perf_counter() - t0
            entry = st._tuned_entry(op, args) if tune_error is None else None
            contenders: dict[str, tuple[dict[str, dict[str, Any]], Any]] = {}
            for impl, why in verdicts.items():
                by_mode = {mode: _row(base, impl, mode, why) for mode in MODES}
                rows.extend(by_mode.values())
                if why is None:
                    contenders[impl] = (by_mode, lambda impl=impl: public(*args, impl=impl, **kwargs))
            tuned = {mode: _row(base, "tuned", mode, tune_error) for mode in MODES}
            for mode, row in tuned.items():
                row["chosen"] = (entry or {}).get("graph" if mode == "graph" and device == "cuda" else "eager")
                row["tune_s"] = round(tune_s, 3)
                row["static"] = static["graph" if mode == "graph" and device == "cuda" else "eager"]
                if entry is not None:
                    row["tuner_times"] = entry.get("times")
            rows.extend(tuned.values())
            contenders["tuned"] = (tuned, lambda: public(*args, **kwargs))
            _time_all(contenders, timers, 1 if smoke else st.ROUNDS, device)
            if device == "cuda":
                torch.cuda.empty_cache()
            if sink is not None:
                for row in rows[first:]:
                    sink.add(row, _row_line(row))
        if after_op is not None:
            after_op(rows)
    return rows


def _verdicts_and_static(op_name: str, args: tuple[Any, ...]) -> tuple[dict[str, str | None], dict[str, str | None]]:
    """From ``explain``: every registered impl -> None if it can take these arguments, else
    why not (sweep_tuning's candidates); and per mode what auto runs without measuring
    (``POLYKERNEL_TUNE`` off): the runnable impl of least rank (the effective ranks: rank rules
    applied, in graph mode those of a call made while a CUDA graph is captured). The static
    choice's time is its forced row's (the issue's claim is about auto, tuned or not)."""
    import polykernel

    def least(impls: list[dict[str, Any]]) -> str | None:
        runnable = [r for r in impls if r["runnable"]]
        return min(runnable, key=lambda r: r["rank"])["name"] if runnable else None

    impls = polykernel.explain(op_name, *args, capturing=False).impls
    graph = polykernel.explain(op_name, *args, capturing=True).impls
    return {r["name"]: (None if r["runnable"] else r["reason"]) for r in impls}, {"eager": least(impls), "graph": least(graph)}


def _row_line(row: dict[str, Any]) -> str:
    """One timed row, as printed when it is kept."""
    why = "" if row["error"] is None else f" ({row['error']})"
    return f"{row['op']} {row['shape']} {row['mode']} {row['impl']}: {_us(row['us'])} µs{why}"


def _error(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"[:200]


def _time_all(contenders: dict[str, tuple[dict[str, dict[str, Any]], Any]], timers: dict[str, Any], rounds: int, device: str) -> None:
    """Interleaved rounds over every contender and mode (a failure ends that contender's mode
    only: an impl may run eagerly but not under capture), then each row's medians."""
    import torch

    samples: dict[tuple[str, str], list[tuple[float, float | None, float | None]]] = {}
    for _ in range(rounds):
        for name, (by_mode, fn) in contenders.items():
            for mode, row in by_mode.items():
                if row["error"] is not None:
                    continue
                try:
                    samples.setdefault((name, mode), []).append(timers[mode](fn))
                except Exception as exc:
                    row["error"] = _error(exc)
                if device == "cuda":
                    torch.cuda.empty_cache()
    for name, (by_mode, _fn) in contenders.items():
        for mode, row in by_mode.items():
            got = samples.get((name, mode))
            if row["error"] is not None or not got:
                continue
            ms = statistics.median(s[0] for s in got)
            row.update({"ms": ms, "us": ms * 1e3, "TB/s": row["bytes"] / (ms * 1e-3) / 1e12, "samples_ms": [s[0] for s in got]})
            if got[0][1] is not None:
                row["gpu_us"] = statistics.median(s[1] for s in got) * 1e3
                row["host_us"] = statistics.median(s[2] for s in got)


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """sweep_tuning's per point summary (fastest, tuned, tuned/fastest), plus the best peer and
    the tuned call against it: tuned/peer (graph) and tuned - peer in µs (eager)."""
    out = st.summarize(rows, dim="tokens")
    for s in out:
        peers = [
            r
            for r in rows
            if (r["op"], r["mode"], r["tokens"]) == (s["op"], s["mode"], s["tokens"]) and r["impl"] in PEERS and r["ms"] is not None
        ]
        peer = min(peers, key=lambda r: r["ms"]) if peers else None
        s["peer"] = peer["impl"] if peer else None
        s["peer_us"] = peer["us"] if peer else None
        tuned_us = s["tuned_ms"] * 1e3 if s["tuned_ms"] is not None else None
        s["tuned_us"] = tuned_us
        s["fastest_us"] = s["fastest_ms"] * 1e3 if s["fastest_ms"] is not None else None
        s["vs_peer"] = None
        s["peer_target"] = None
        here = [r for r in rows if (r["op"], r["mode"], r["tokens"]) == (s["op"], s["mode"], s["tokens"])]
        s["static"] = next((r.get("static") for r in here if r["impl"] == "tuned"), None)
        static_row = next((r for r in here if r["impl"] == s["static"] and r["ms"] is not None), None)
        s["static_us"] = static_row["us"] if static_row else None
        s["static_ratio"] = static_row["ms"] / s["fastest_ms"] if static_row and s["fastest_ms"] else None
        s["static_within"] = None if s["static_ratio"] is None else bool(s["static_ratio"] <= STATIC_CLAIM)
        if peer and tuned_us is not None:
            if s["mode"] == "graph":
                s["vs_peer"] = tuned_us / peer["us"]
                s["peer_target"] = bool(s["vs_peer"] <= 1.0)
            else:
                s["vs_peer"] = tuned_us - peer["us"]
                s["peer_target"] = bool(s["vs_peer"] <= PEER_EAGER_US)
    return out


def _ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _us(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}" if v < 100 else f"{v:.0f}"


def print_table(rows: list[dict[str, Any]], summary: list[dict[str, Any]]) -> None:
    """Per point: the fastest, the tuned choice, their ratio, the best peer, and every impl's µs;
    then one line per op and mode."""
    print(
        f"{'op':<20}{'mode':<6}{'tokens':>7}  {'fastest':<14}{'µs':>8}  {'tuned':<14}{'µs':>8}{'ratio':>7}  {'static':<14}{'ratio':>7}  {'peer':<11}{'vs peer':>8}  impls (µs)"
    )
    for s in summary:
        vs = "-" if s["vs_peer"] is None else f"{s['vs_peer']:.3f}" if s["mode"] == "graph" else f"{s['vs_peer']:+.2f}"
        impls = " ".join(
            f"{r['impl']}={_us(r['us'])}"
            for r in sorted(
                (r for r in rows if (r["op"], r["mode"], r["tokens"]) == (s["op"], s["mode"], s["tokens"]) and r["impl"] != "tuned"),
                key=lambda r: (r["us"] is None, r["us"] or 0.0),
            )
            if r["us"] is not None
        )
        flag = "" if s["within_claim"] else "  > 5%"
        print(
            f"{s['op']:<20}{s['mode']:<6}{s['tokens']:>7}  {s['fastest'] or '-':<14}{_us(s['fastest_us']):>8}  "
            f"{s['tuned'] or '-':<14}{_us(s['tuned_us']):>8}{s['ratio']:>7.3f}  {s['static'] or '-':<14}{_ratio(s['static_ratio']):>7}  {s['peer'] or '-':<11}{vs:>8}  {impls}{flag}"
        )
    print()
    for op in dict.fromkeys(s["op"] for s in summary):
        for mode in MODES:
            pts = [s for s in summary if (s["op"], s["mode"]) == (op, mode)]
            if not pts:
                continue
            worst = max((s["ratio"] for s in pts if not math.isnan(s["ratio"])), default=math.nan)
            line = f"{op} {mode}: tuned within 5% of the fastest at {sum(s['within_claim'] for s in pts)} of {len(pts)} points (worst {worst:.3f})"
            static = [s for s in pts if s["static_within"] is not None]
            if static:
                worst_static = max(s["static_ratio"] for s in static)
                line += f"; static within 2% at {sum(s['static_within'] for s in static)} of {len(static)} (worst {worst_static:.3f})"
            vs_peer = [s for s in pts if s["peer_target"] is not None]
            if vs_peer:
                target = "<= the fastest peer" if mode == "graph" else f"<= the fastest peer + {PEER_EAGER_US:g} µs"
                line += f"; {target} at {sum(s['peer_target'] for s in vs_peer)} of {len(vs_peer)}"
            else:
                line += "; no peer ran"
            print(line)
    worst = max((s["ratio"] for s in summary if not math.isnan(s["ratio"])), default=math.nan)
    print(
        f"tuned within 5% of the fastest at {sum(s['within_claim'] for s in summary)} of {len(summary)} points; worst tuned/fastest {worst:.3f}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for sweep_serving.{json,csv,png} and the tuning store")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU through Triton's interpreter (a test of the script)")
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    p.add_argument("--tokens", nargs="+", type=int, default=None, help=f"token counts (default {' '.join(map(str, TOKENS))}; --smoke: 1 8)")
    a = p.parse_args(argv)
    out = st.prepare(p, a.out, a.smoke)
    tokens = a.tokens or list(SMOKE_TOKENS if a.smoke else TOKENS)
    import torch

    started = time.perf_counter()
    meta = {
        "device": torch.cuda.get_device_name() if not a.smoke else "cpu (smoke)",
        "torch": torch.__version__,
        "dtype": "bfloat16 (the quantisers write float8_e4m3fn)",
        "tokens": tokens,
        "widths": {op: width(op, a.smoke) for op in a.ops},
        "peers": _versions(),
        "timing": (
            "graph: CUDA-graph replays, do_bench(warmup=5, rep=20); eager: max(do_bench GPU time, host µs per call, best of 9 rounds of 20 calls behind a ~5 ms GPU hold); "
            f"median of {st.ROUNDS} interleaved rounds"
            if not a.smoke
            else "CPU wall clock (both modes)"
        ),
    }

    # {"meta", "complete", "rows", "summary"}: rows written per point; the summary so far per op
    sink = RowFile(out / "sweep_serving.json", {"meta": meta})
    announce(len(a.ops) * len(tokens), per_case_s=1 if a.smoke else 3, what="points (op, tokens)", path=str(sink.path))

    def write(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        summary = summarize(rows)
        meta["seconds"] = round(time.perf_counter() - started, 1)
        sink.header["summary"] = summary  # in the file from the next row on, and at finish
        with open(out / "sweep_serving.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
        return summary

    rows = sweep(a.smoke, a.ops, tokens, after_op=write, sink=sink)
    summary = write(rows)
    sink.finish()
    plotted = st.plot(
        rows, summary, out / "sweep_serving.png", x="tokens", y="us", title="{op} {mode} (bf16)", log_y=True, cols=2, order=OPS
    )
    print_table(rows, summary)
    print(f"wrote {out / 'sweep_serving.json'}, .csv{', .png' if plotted else ' (no matplotlib: no plot)'} in {meta['seconds']} s")
    return 0


def _versions() -> dict[str, str | None]:
    """The serving peers' installed versions (None: not installed)."""
    from importlib import metadata

    out: dict[str, str | None] = {}
    for dist in ("flashinfer-python", "sglang-kernel", "sgl-kernel"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


if __name__ == "__main__":
    sys.exit(main())
