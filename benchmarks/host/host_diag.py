"""Why an eager fwd+bwd call of our Triton norms takes longer than its GPU time (issue 11).

    PYTHONPATH=src python benchmarks/host/host_diag.py --out DIR                 # CUDA GPU, ~40 s
    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/host/host_diag.py --out DIR --smoke   # CPU check

host_profile.py found rms_norm 16384x4096 bf16 fwd+bwd at 595 µs per back-to-back call against
192 µs of GPU time and 307 µs of host time: more than either, as if host and GPU took turns. This
script separates the candidate causes, per case (rms_norm, layer_norm, rope fwd+bwd at the
host_profile shapes) and variant:

- ``auto`` (polykernel's choice), ``triton`` (the impl called directly), ``fast launch off``
  (every kernel through ``kernel[grid]``), ``lean apply off`` (plain ``Function.apply``),
  ``bwd on caller`` (autograd multithreading off: no hand-off to the device thread), ``gc off``
  (Python's collector disabled), ``torch`` (the torch impl), and a ``floor`` case: an empty
  ``autograd.Function`` (one allocation, no kernel) through the same ``autograd.grad``.
- Figures, µs per call: ``gpu`` (CUDA-graph replay), ``per call`` (median and min of 7 rounds of
  50 back-to-back calls), ``issue`` (the same rounds, time until the last call returned, before
  the final synchronize: the host's pace with the GPU running), ``host`` (the host's pace with the
  GPU asleep, polykernel.tools.bench.host_us_per_call). ``per call`` ≈ max(gpu, issue) means no
  serialisation; ``issue`` ≫ ``host`` means the host waits on the GPU (or is slowed by it).
- ``gc``: collections per round by generation and ms spent in them (a full collection of a
  process holding torch and Triton costs tens of ms).
- ``syncs``: warnings from ``torch.cuda.set_sync_debug_mode("warn")`` over 3 calls (backward on
  the device thread, then on the caller so the Python stack shows), count and first stacks.
- per case, a ``torch.profiler`` trace of 5 ``auto`` calls: CUDA API calls per call by name (a
  ``cudaStreamSynchronize``, ``cudaFree`` or ``cudaMemcpy`` there is a sync), GPU busy share and
  the largest GPU gap; the chrome trace goes to ``DIR/trace-<case>.json``.

Writes ``DIR/host_diag.json`` (``meta``, ``complete``, ``rows``: one record per case, each written
as the case ends; ``results`` before issue 35) and ``DIR/host_diag.md``; prints the table as it goes.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # host_profile's helpers, beside this file

import host_profile as hp

import polykernel
from polykernel.core import registry
from polykernel.tools.bench import host_us_per_call
from polykernel.tools.rows import RowFile, announce

CASES = [
    ("rms_norm", "16384x4096", (16384, 4096)),
    ("layer_norm", "16384x4096", (16384, 4096)),
    ("rope", "q4x32x4096x128,k8", (4, 32, 4096, 128)),
]
SMOKE_CASES = [("rms_norm", "4x64", (4, 64)), ("layer_norm", "4x64", (4, 64)), ("rope", "q1x4x8x16,k1", (1, 4, 8, 16))]
ROUNDS, CALLS = 7, 50
SYNC_PATTERNS = ("Synchronize", "cudaMemcpy", "cudaFree", "cudaMalloc", "cudaHostAlloc", "cuMemFree", "cuMemAlloc", "cuCtxSynchronize")


class _Floor(torch.autograd.Function):
    """The least a Python autograd node can do: one allocation forward, pass-through backward."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        return dy


# -- switches ---------------------------------------------------------------------------------


@contextlib.contextmanager
def _fast_launch(on: bool) -> Iterator[None]:
    from polykernel.backends.triton import _launch

    old = _launch.set_enabled(on)
    try:
        yield
    finally:
        _launch.set_enabled(old)


@contextlib.contextmanager
def _lean_apply(on: bool) -> Iterator[None]:
    from polykernel.backends.triton import _autograd

    old = _autograd.set_enabled(on)
    try:
        yield
    finally:
        _autograd.set_enabled(old)


@contextlib.contextmanager
def _gc_off() -> Iterator[None]:
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def variants(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, tuple[Callable[[], Any], Callable[[], Any]]]:
    """Name -> (call, context factory)."""
    public = getattr(polykernel, op.name)
    pos = hp._positional(op, args, kwargs)
    null = contextlib.nullcontext
    out: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {"auto": (lambda: public(*args, **kwargs), null)}
    tri = hp._impl(op, "triton")
    if tri is not None:
        call = lambda: tri(*pos)
        out["triton"] = (call, null)
        out["fast launch off"] = (call, lambda: _fast_launch(False))
        out["lean apply off"] = (call, lambda: _lean_apply(False))
    out["bwd on caller"] = (out["auto"][0], lambda: torch.autograd.set_multithreading_enabled(False))
    out["gc off"] = (out["auto"][0], _gc_off)
    ref = hp._impl(op, "torch")
    if ref is not None:
        out["torch"] = (lambda: ref(*pos), null)
    return out


# -- measurements -----------------------------------------------------------------------------


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class _GCWatch:
    """Collections by generation and seconds spent in them, while active."""

    def __init__(self) -> None:
        self.counts = [0, 0, 0]
        self.seconds = 0.0
        self._t = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t
            self.counts[info["generation"]] += 1

    def __enter__(self) -> _GCWatch:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


def rounds(step: Callable[[], Any], n_rounds: int | None = None, calls: int | None = None) -> dict[str, Any]:
    """Back-to-back calls: per call (wall, to the end of the GPU work) and issue (host) time."""
    n_rounds, calls = n_rounds or ROUNDS, calls or CALLS
    for _ in range(5 if calls > 5 else 1):
        step()
    per, issue = [], []
    with _GCWatch() as watch:
        for _ in range(n_rounds):
            _sync()
            t0 = time.perf_counter()
            for _ in range(calls):
                step()
            t1 = time.perf_counter()
            _sync()
            t2 = time.perf_counter()
            per.append((t2 - t0) / calls * 1e6)
            issue.append((t1 - t0) / calls * 1e6)
    per.sort()
    issue.sort()
    return {
        "per_call_us": per[len(per) // 2],
        "per_call_min_us": per[0],
        "per_call_max_us": per[-1],
        "issue_us": issue[len(issue) // 2],
        "issue_min_us": issue[0],
        "gc_per_round": [c / n_rounds for c in watch.counts],
        "gc_ms_per_round": watch.seconds * 1e3 / n_rounds,
    }


def sync_warnings(step: Callable[[], Any], calls: int = 3) -> dict[str, Any]:
    """Synchronizing CUDA calls torch reports (set_sync_debug_mode), with the Python stack."""
    if not torch.cuda.is_available():
        return {"count": 0, "first": [], "note": "no CUDA"}
    found: list[dict[str, Any]] = []

    def record(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        stack = [f"{f.filename}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-1]][-6:]
        found.append({"message": str(message)[:200], "at": f"{filename}:{lineno}", "stack": stack})

    step()
    _sync()
    for caller_thread in (False, True):
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            ctx = torch.autograd.set_multithreading_enabled(False) if caller_thread else contextlib.nullcontext()
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with ctx:
                    for _ in range(calls):
                        step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        _sync()
    distinct = list({(f["message"], f["at"]): f for f in found}.values())
    return {"count": len(found), "first": distinct[:3]}


def profile(step: Callable[[], Any], trace: Path | None, calls: int = 5) -> dict[str, Any]:
    """CUDA API calls per call, GPU busy share and the largest GPU gap over ``calls`` calls."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for _ in range(3):
        step()
    _sync()
    with tprofile(activities=acts) as prof:
        for _ in range(calls):
            step()
        _sync()
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    api: dict[str, list[float]] = {}
    kernels: list[tuple[float, float]] = []
    for e in prof.events():
        name = e.name
        on_gpu = str(getattr(e, "device_type", "")).endswith("CUDA")
        if on_gpu:
            kernels.append((e.time_range.start, e.time_range.end))
        elif name.startswith(("cuda", "cu")) and not name.startswith("cuda::"):
            api.setdefault(name, []).append(e.time_range.end - e.time_range.start)
    summary: dict[str, Any] = {
        "api_per_call": {k: {"n": len(v) / calls, "us_total_per_call": sum(v) / calls, "max_us": max(v)} for k, v in sorted(api.items())},
        "sync_like": sorted(k for k in api if any(p in k for p in SYNC_PATTERNS)),
    }
    if kernels:
        kernels.sort()
        busy, gaps, end = 0.0, [], kernels[0][0]
        for s, e in kernels:
            if s > end:
                gaps.append(s - end)
            busy += max(0.0, e - max(s, end))
            end = max(end, e)
        span = end - kernels[0][0]
        summary.update(
            gpu_busy_share=busy / span if span else 1.0, max_gpu_gap_us=max(gaps, default=0.0), gpu_span_per_call_us=span / calls
        )
    return summary


def measure(name: str, call: Callable[[], Any], ctx: Callable[[], Any], inputs: list[torch.Tensor]) -> dict[str, Any]:
    row: dict[str, Any] = {"variant": name}
    cuda = torch.cuda.is_available()
    try:
        with ctx():
            step = hp._step(call, inputs, "fwd+bwd")
            # Each figure on its own: one that fails (a graph of the kernel-less floor) keeps the rest.
            for key, fn in (("gpu_us", hp.gpu_us if cuda else None), ("host_us", host_us_per_call if cuda else None)):
                if fn is not None:
                    try:
                        row[key] = fn(step)
                    except Exception as exc:
                        row[f"{key}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            row.update(rounds(step))
            row["syncs"] = sync_warnings(step)
    except Exception as exc:  # one failing variant must not end the run
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return row


def run_case(op_name: str, label: str, shape: tuple[int, ...], out: Path, device: str) -> dict[str, Any]:
    op = registry.get_op(op_name)
    case = op.example(shape, torch.bfloat16 if device == "cuda" else torch.float32, device, True)
    args, kwargs = case.args, case.kwargs
    inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    rows = []
    for name, (call, ctx) in variants(op, args, kwargs).items():
        row = measure(name, call, ctx, inputs)
        rows.append(row)
        print(_line(op_name, label, row), flush=True)
    if op_name == "rms_norm":  # the floor: a Python Function that does nothing, same inputs
        x = inputs[0]
        row = measure("floor (empty Function)", lambda: _Floor.apply(x), contextlib.nullcontext, [x])
        rows.append(row)
        print(_line(op_name, label, row), flush=True)
    tag = f"{op_name}-{label}".replace(",", "_")
    try:
        prof = profile(hp._step(variants(op, args, kwargs)["auto"][0], inputs, "fwd+bwd"), out / f"trace-{tag}.json")
    except Exception as exc:
        prof = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    print(f"  profile of auto: {json.dumps(_short_profile(prof))}", flush=True)
    chosen = ",".join(sorted({d["impl"] for d in polykernel.decisions(op.id)}))
    del case, args, kwargs, inputs
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"op": op_name, "shape": label, "chosen": chosen, "rows": rows, "profile_auto": prof}


def _short_profile(p: dict[str, Any]) -> dict[str, Any]:
    if "error" in p:
        return p
    keep = {k: v for k, v in p.items() if k != "api_per_call"}
    keep["api_n_per_call"] = {k: v["n"] for k, v in p["api_per_call"].items()}
    return keep


def _f(v: Any, fmt: str = "{:7.1f}") -> str:
    return fmt.format(v) if isinstance(v, (int, float)) else f"{'-':>7}"


def _line(op: str, label: str, r: dict[str, Any]) -> str:
    head = f"{op:<11} {label:<18} {r['variant']:<23}"
    if "error" in r:
        return f"{head} ERROR {r['error']}"
    gcs = "/".join(f"{c:g}" for c in r["gc_per_round"])
    return (
        f"{head} gpu {_f(r.get('gpu_us'))}  per call {_f(r['per_call_us'])} (min {_f(r['per_call_min_us'])})  "
        f"issue {_f(r['issue_us'])}  host {_f(r.get('host_us'))}  gc/round {gcs} {r['gc_ms_per_round']:.1f} ms  "
        f"syncs {r['syncs']['count']}"
    )


def markdown(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    out = [
        f"# Host diagnosis: {meta['device']}, torch {meta['torch']}, triton {meta['triton']}",
        "",
        f"µs per call. per call: median (min) of {ROUNDS} rounds of {CALLS} back-to-back calls; issue: the same rounds",
        "until the last call returned; host: issue pace with the GPU asleep. gc: collections per round",
        "(gen0/gen1/gen2) and ms. syncs: sync-debug-mode warnings over 6 calls.",
        "",
        "| op | shape | variant | GPU | per call | issue | host | per call / GPU | gc per round | syncs |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        for r in res["rows"]:
            if "error" in r:
                out.append(f"| {res['op']} | {res['shape']} | {r['variant']} | error: {r['error'][:80]} |||||||")
                continue
            ratio = r["per_call_us"] / r["gpu_us"] if r.get("gpu_us") else None
            gcs = "/".join(f"{c:g}" for c in r["gc_per_round"]) + f" ({r['gc_ms_per_round']:.1f} ms)"
            out.append(
                f"| {res['op']} | {res['shape']} | {r['variant']} | {_f(r.get('gpu_us'), '{:.1f}')} | "
                f"{r['per_call_us']:.1f} ({r['per_call_min_us']:.1f}) | {r['issue_us']:.1f} | {_f(r.get('host_us'), '{:.1f}')} | "
                f"{_f(ratio, '{:.2f}')} | {gcs} | {r['syncs']['count']} |"
            )
    out += ["", "Profile of 5 `auto` calls per case (CUDA API calls per call; sync-like calls; GPU busy share):", ""]
    for res in results:
        out.append(f"- {res['op']} {res['shape']} (chosen: {res['chosen']}): `{json.dumps(_short_profile(res['profile_auto']))}`")
    syncs = [(res["op"], r["variant"], r["syncs"]) for res in results for r in res["rows"] if r.get("syncs", {}).get("count")]
    if syncs:
        out += ["", "Synchronizing calls reported:", ""]
        for op, variant, s in syncs:
            for f in s["first"]:
                out.append(f"- {op} / {variant}: {f['message']} at {f['at']}; stack: {' <- '.join(reversed(f['stack']))}")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for host_diag.json, .md and the traces")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (interpreter): checks the script runs")
    parser.add_argument("--ops", default="", help="comma-separated op names (default: rms_norm,layer_norm,rope)")
    a = parser.parse_args()
    device = "cpu" if a.smoke else "cuda"
    if a.smoke:  # the interpreter runs a call in ~20 ms: enough to exercise every path
        global ROUNDS, CALLS
        ROUNDS, CALLS = 2, 3
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("host_diag.py needs a CUDA GPU (or --smoke)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    wanted = {o for o in a.ops.split(",") if o}
    t0 = time.time()
    import triton

    meta = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("POLYKERNEL_", "TRITON_", "PYTORCH_", "CUDA_LAUNCH"))},
        "gc_threshold": gc.get_threshold(),
    }
    cases = [c for c in (SMOKE_CASES if a.smoke else CASES) if not wanted or c[0] in wanted]
    # run_case prints its lines as it goes: the file gets the case's record, nothing more is printed
    sink = RowFile(out / "host_diag.json", {"meta": meta}, echo=lambda line: line and print(line, flush=True))
    announce(len(cases), per_case_s=10, what="cases (each: its variants, then a profile)", path=str(sink.path))
    for op_name, label, shape in cases:
        polykernel.clear_caches()
        sink.add(run_case(op_name, label, shape, out, device), "")
    results = sink.rows
    meta.update(gc_tracked_objects=len(gc.get_objects()), seconds=round(time.time() - t0, 1))
    sink.finish()
    (out / "host_diag.md").write_text(markdown(results, meta))
    print(f"wrote {out / 'host_diag.json'} and host_diag.md in {meta['seconds']} s")


if __name__ == "__main__":
    main()
