"""Where the host time of an eager op call goes, per op, on a CUDA GPU (issue 11).

    PYTHONPATH=src python benchmarks/host/host_profile.py --out DIR [--ops rms_norm,rope] [--quick]

For each case (op, shape, fwd or fwd+bwd; bf16; the issue's training and decode shapes) and each
contender — ``polykernel`` (automatic choice), ``polykernel[py]`` (the same with the native
C++ path off: the norms' host path in Python), ``triton`` (the registered Triton impl called
directly), ``triton[grid]`` (the same with the direct launch and the native path off: every
kernel through ``kernel[grid]``), ``torch`` (the torch impl, i.e. ``F.rms_norm``/``F.layer_norm``/... where it
applies, called directly), and for the serving activations ``polykernel[sgl_kernel]`` and
``polykernel[flashinfer]`` (the peers forced through the dispatcher; an error row without them) — three figures:

- ``gpu_us``: GPU time per call, from replays of a CUDA graph of 10 calls (no host in it);
- ``per_call_us``: wall time per call of 100 back-to-back calls (what an eager user gets);
- ``host_us``: CPU time to issue one call while the GPU is kept busy (``torch.cuda._sleep``), so
  the GPU is never the bottleneck (polykernel.tools.bench.host_us_per_call).

``per_call_us / gpu_us`` above 1 means the call waits on the host. For the ``polykernel``
contender the host time is also split by cProfile (200 calls) into dispatch (the dispatcher and
the public function), checks, allocation (``torch.empty*``/``zeros``), launch (``_launch`` and
Triton's runtime), native (the C++ call of the native path: its allocations, launches and
autograd node), autograd (``autograd.Function`` plumbing and the engine, including the backward
the engine runs), other torch ops and the rest; cProfile inflates Python, so the shares are scaled to the measured ``host_us``. The
top functions of each profile go to ``DIR/profiles/``. Writes ``DIR/host_profile.json`` and
``DIR/host_profile.md``. Forward cases of decode shapes run under ``torch.inference_mode()``.
About 1-2 minutes on an H200 (Triton compiles included).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import inspect
import io
import platform
import pstats
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import polykernel
from polykernel.core import registry
from polykernel.tools.bench import capture_graph, host_us_per_call
from polykernel.tools.rows import RowFile, announce

# (op, label, example shape, modes). Decode shapes: forward only, inference.
CASES: list[tuple[str, str, tuple[int, ...], tuple[str, ...]]] = [
    ("rms_norm", "16384x4096", (16384, 4096), ("fwd", "fwd+bwd")),
    ("rms_norm", "1x4096", (1, 4096), ("fwd",)),
    ("rms_norm", "64x4096", (64, 4096), ("fwd",)),
    ("layer_norm", "16384x4096", (16384, 4096), ("fwd", "fwd+bwd")),
    ("fused_add_rms_norm", "16384x4096", (16384, 4096), ("fwd", "fwd+bwd")),
    ("fused_add_rms_norm", "8x4096", (8, 4096), ("fwd",)),
    ("swiglu", "16384x14336", (16384, 14336), ("fwd", "fwd+bwd")),
    ("swiglu", "1x14336", (1, 14336), ("fwd",)),
    ("rope", "q4x32x4096x128,k8", (4, 32, 4096, 128), ("fwd", "fwd+bwd")),
    ("rope", "q8x32x1x128,k8", (8, 32, 1, 128), ("fwd",)),
    # the serving activations at decode size, beside the serving peers (the H200's fifth run of
    # 2026-12-04: sgl-kernel's launch 25-30% cheaper than our native entry's, not yet explained)
    ("silu_and_mul", "1x28672", (1, 28672), ("fwd",)),
    ("gelu_and_mul", "1x28672", (1, 28672), ("fwd",)),
    ("cross_entropy", "8192x128256", (8192, 128256), ("fwd", "fwd+bwd")),
]
SERVING_PEERS = ("sgl_kernel", "flashinfer")
QUICK = {("rms_norm", "16384x4096"), ("rms_norm", "1x4096"), ("swiglu", "1x14336"), ("rope", "q8x32x1x128,k8")}

CATEGORIES = ("dispatch", "checks", "allocation", "launch", "native", "autograd", "torch ops", "other")


def _positional(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The arguments as the dispatcher hands them to an impl: every reference parameter, in order."""
    bound = inspect.signature(op.reference).bind(*args, **kwargs)
    bound.apply_defaults()
    return tuple(bound.arguments.values())


def _impl(op: Any, name: str) -> Callable[..., Any] | None:
    spec = registry.specs_for(op).get(name)
    return registry.load_impl(spec) if spec is not None else None


def _outputs(out: Any) -> list[torch.Tensor]:
    outs = out if isinstance(out, tuple) else (out,)
    return [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]


def _step(fn: Callable[[], Any], inputs: list[torch.Tensor], mode: str) -> Callable[[], Any]:
    if mode == "fwd":
        return fn
    cots = [torch.randn_like(o) for o in _outputs(fn())]
    return lambda: torch.autograd.grad(_outputs(fn()), inputs, cots)


def gpu_us(step: Callable[[], Any], calls: int = 10, replays: int = 20) -> float:
    """GPU time per call from CUDA-graph replays (the host is out of the picture)."""
    graph = capture_graph(step, calls)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (replays * calls))
    del graph
    return sorted(times)[len(times) // 2]


def per_call_us(step: Callable[[], Any], calls: int = 100) -> float:
    """Wall time per call of back-to-back calls (median of 5)."""
    for _ in range(5):
        step()
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) / calls * 1e6)
    return sorted(times)[len(times) // 2]


def _category(filename: str, name: str) -> str:
    f = filename.replace("\\", "/")
    if "polykernel hot path" in f or f.endswith(("polykernel/op.py", "polykernel/dispatch.py")) or "/polykernel/ops/" in f:
        return "checks" if f.endswith("_checks.py") or name == "validate" else "dispatch"
    if "backends/triton/_launch.py" in f or "/triton/runtime/" in f or "/triton/backends/" in f or "/triton/compiler/" in f:
        return "launch"
    if "launch" in name and f == "~":
        return "launch"
    if f == "~" and "polykernel_native." in name:  # the native path's C++ call
        return "native"
    if f == "~" and any(k in name for k in ("torch.empty", "torch.zeros", "empty_like", "empty_strided", "new_empty")):
        return "allocation"
    if "/torch/autograd/" in f or "run_backward" in name or ("apply" in name and f == "~") or "FunctionBase" in name:
        return "autograd"
    if f == "~" and ("torch" in name or "Tensor" in name or "TensorBase" in name):
        return "torch ops"
    return "other"


def breakdown(step: Callable[[], Any], host: float, out_file: Path, calls: int = 200) -> dict[str, float]:
    """Host microseconds per call by category: cProfile's shares scaled to ``host``. The GPU may
    fall behind during these calls; a host sync would then show as waiting in 'torch ops'."""
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    # The backward on this thread (autograd's device threads are invisible to cProfile).
    with torch.autograd.set_multithreading_enabled(False):
        prof.enable()
        for _ in range(calls):
            step()
        prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof)
    totals = dict.fromkeys(CATEGORIES, 0.0)
    for (filename, _line, name), (_cc, _nc, tottime, _ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        totals[_category(filename, name)] += tottime
    whole = sum(totals.values()) or 1.0
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    out_file.write_text(text.getvalue())
    return {k: host * v / whole for k, v in totals.items()}


def contenders(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    public = getattr(polykernel, op.name)
    pos = _positional(op, args, kwargs)
    out: dict[str, Callable[[], Any]] = {"polykernel": lambda: public(*args, **kwargs)}
    out["polykernel[py]"] = out["polykernel"]  # measured with the native (C++) path off
    triton_impl = _impl(op, "triton")
    if triton_impl is not None:
        out["triton"] = lambda: triton_impl(*pos)
        out["triton[grid]"] = out["triton"]  # measured with the direct launch off
    torch_impl = _impl(op, "torch")
    if torch_impl is not None:
        out["torch"] = lambda: torch_impl(*pos)
    for peer in SERVING_PEERS:  # through the dispatcher, as a user forcing them calls them
        if peer in registry.specs_for(op.id):
            out[f"polykernel[{peer}]"] = lambda peer=peer: public(*args, impl=peer, **kwargs)
    return out


@contextlib.contextmanager
def launch_paths(fast: bool, native: bool):
    """The direct Triton launch and the native (C++) path on or off for one contender."""
    from polykernel.backends.triton import _launch, _native

    old = _launch.set_enabled(fast), _native.set_enabled(native)
    try:
        yield
    finally:
        _launch.set_enabled(old[0])
        _native.set_enabled(old[1])


def run_case(
    op_name: str, label: str, shape: tuple[int, ...], mode: str, decode: bool, prof_dir: Path, sink: RowFile | None = None
) -> list[dict[str, Any]]:
    """The case's row per contender, each kept in ``sink`` (default: printed only) as it is measured."""
    op = registry.get_op(op_name)
    grad = mode == "fwd+bwd"
    case = op.example(shape, torch.bfloat16, "cuda", grad)
    args, kwargs = case.args, case.kwargs
    inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    rows = []
    # Decode shapes (forward-only cases) as a server runs them; other forwards under no_grad.
    ctx = contextlib.nullcontext if grad else torch.inference_mode if decode else torch.no_grad
    for who, fn in contenders(op, args, kwargs).items():
        row: dict[str, Any] = {"op": op_name, "shape": label, "mode": mode, "impl": who}
        try:
            with ctx(), launch_paths(fast=who != "triton[grid]", native=who in ("polykernel", "triton")):
                step = _step(fn, inputs, mode)
                row["gpu_us"] = gpu_us(step)
                row["per_call_us"] = per_call_us(step)
                row["host_us"] = host_us_per_call(step)
                row["per_call_over_gpu"] = row["per_call_us"] / row["gpu_us"]
                if who == "polykernel" or who.removeprefix("polykernel[").rstrip("]") in SERVING_PEERS:  # where the host time goes
                    row["chosen"] = ",".join(sorted({d["impl"] for d in polykernel.decisions(op.id)}))
                    name = (
                        f"{op_name}-{label}-{mode}{who.removeprefix('polykernel')}".replace("+", "p")
                        .replace(",", "_")
                        .replace("[", "-")
                        .replace("]", "")
                    )
                    row["breakdown_us"] = breakdown(step, row["host_us"], prof_dir / f"{name}.txt")
        except Exception as exc:  # one failing contender must not end the run
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        rows.append(row)
        (sink or RowFile(None)).add(row, _line(row))
    del case, args, kwargs, inputs
    torch.cuda.empty_cache()
    return rows


def _line(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"{r['op']:<19} {r['shape']:<18} {r['mode']:<8} {r['impl']:<13} ERROR {r['error']}"
    return (
        f"{r['op']:<19} {r['shape']:<18} {r['mode']:<8} {r['impl']:<13} gpu {r['gpu_us']:8.1f} us  "
        f"per call {r['per_call_us']:8.1f} us  host {r['host_us']:7.1f} us  ratio {r['per_call_over_gpu']:5.2f}"
    )


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    def cell(r: dict[str, Any] | None, key: str, fmt: str = "{:.1f}") -> str:
        return "" if r is None or key not in r else fmt.format(r[key])

    out = [
        f"# Host profile: {meta['device']}, torch {meta['torch']}, triton {meta['triton']}, bf16",
        "",
        "GPU = CUDA-graph replay per call; per call = back-to-back wall time; host = CPU time to issue",
        "one call with the GPU kept busy. µs. ratio = per call / GPU (polykernel).",
        "",
        "| op | shape | mode | polykernel GPU | per call | host | ratio | polykernel[py] per call | polykernel[py] host | triton host | triton[grid] host | torch GPU | torch per call | torch host |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys = list(dict.fromkeys((r["op"], r["shape"], r["mode"]) for r in rows))
    by = {(r["op"], r["shape"], r["mode"], r["impl"]): r for r in rows}
    for k in keys:
        pk, py, tr, tg, th = (by.get((*k, who)) for who in ("polykernel", "polykernel[py]", "triton", "triton[grid]", "torch"))
        out.append(
            f"| {k[0]} | {k[1]} | {k[2]} | {cell(pk, 'gpu_us')} | {cell(pk, 'per_call_us')} | {cell(pk, 'host_us')} | "
            f"{cell(pk, 'per_call_over_gpu', '{:.2f}')} | {cell(py, 'per_call_us')} | {cell(py, 'host_us')} | "
            f"{cell(tr, 'host_us')} | {cell(tg, 'host_us')} | "
            f"{cell(th, 'gpu_us')} | {cell(th, 'per_call_us')} | {cell(th, 'host_us')} |"
        )
    out += ["", "Host time of the polykernel call by category (µs, cProfile shares scaled to the measured host time):", ""]
    out += ["| op | shape | mode | " + " | ".join(CATEGORIES) + " |", "|---|---|---|" + "---|" * len(CATEGORIES)]
    for k in keys:
        pk = by.get((*k, "polykernel"))
        if pk and "breakdown_us" in pk:
            out.append(f"| {k[0]} | {k[1]} | {k[2]} | " + " | ".join(f"{pk['breakdown_us'][c]:.1f}" for c in CATEGORIES) + " |")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for host_profile.json, .md and profiles/")
    parser.add_argument("--ops", default="", help="comma-separated op names (default: all)")
    parser.add_argument("--quick", action="store_true", help="four cases only (~20 s)")
    a = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("host_profile.py needs a CUDA GPU")
    out = Path(a.out)
    prof_dir = out / "profiles"
    prof_dir.mkdir(parents=True, exist_ok=True)
    wanted = {o for o in a.ops.split(",") if o}
    from polykernel.backends.triton import _native

    print(f"native path: {'on' if _native.module(wait=True) is not None else 'off'}", flush=True)  # built before timing
    t0 = time.time()
    import triton

    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
    }
    cases = [
        (op_name, label, shape, mode, modes == ("fwd",))
        for op_name, label, shape, modes in CASES
        if not ((wanted and op_name not in wanted) or (a.quick and (op_name, label) not in QUICK))
        for mode in modes
    ]
    sink = RowFile(out / "host_profile.json", {"meta": meta})  # {"meta", "complete", "rows"}: each row as measured
    announce(len(cases), per_case_s=5, what="cases (about 5 contenders each)", path=str(sink.path))
    rows: list[dict[str, Any]] = []
    for op_name, label, shape, mode, decode in cases:
        polykernel.clear_caches()
        rows += run_case(op_name, label, shape, mode, decode, prof_dir, sink)
    meta["seconds"] = round(time.time() - t0, 1)
    sink.finish()
    (out / "host_profile.md").write_text(markdown(rows, meta))
    print(f"wrote {out / 'host_profile.json'} and host_profile.md in {meta['seconds']} s")


if __name__ == "__main__":
    main()
