"""A/B the Triton kernels that trail (issue 11) on a CUDA GPU, one variant setting at a time.

    PYTHONPATH=src python benchmarks/kernels/kernel_variants.py --out DIR [--only rms_norm,rope,fused_add_rms_norm,gelu_and_mul,flce]

Each variant sets module constants of a Triton backend file (the settings the kernels read at
launch: ``rms_norm.FWD_VARIANT``, ``TUNE`` entries, ``rope.ROWS_MIN_T``/``ROW_ELEMS``/``ROW_WARPS``/``ELEMS``/``MAX_WARPS``), then times the
Triton impl (``impl="triton"``) in bf16 from CUDA-graph replays, fwd and fwd+bwd, and reports
TB/s on the op's ``bytes_moved``. The first row of each group is the current default. Targets
(H200): rms_norm fwd 16384x4096 >= 3.9 TB/s; rope q4x32x4096x128 fwd >= 3.9, fwd+bwd >= 3.85;
fused_add_rms_norm fwd+bwd >= 3.55.

``flce`` (fused linear cross-entropy, N=8192 H=4096 V=128256) compares one eager call with one
CUDA-graph replay, with a cotangent of exactly 1 (eager then skips scaling the gradients) and a
random one, and lists the GPU kernels of each under torch.profiler, so that a kernel that is
slower inside the graph (or one that only the graph runs) shows by name.

Writes ``DIR/kernel_variants.json`` and ``DIR/kernel_variants.md``. About 2 minutes on an H200.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "host"))  # host_profile's helpers, in benchmarks/host/
from host_profile import gpu_us, per_call_us

import polykernel
from polykernel.backends.triton import fused_add_rms_norm as tfa
from polykernel.backends.triton import glu as tglu
from polykernel.backends.triton import rms_norm as trms
from polykernel.backends.triton import rope as trope
from polykernel.core import registry
from polykernel.tools.bench import capture_graph
from polykernel.tools.rows import RowFile, announce

# group -> (op, shape, modes, [(label, {module attribute or TUNE key: value})])
GROUPS: dict[str, tuple[str, tuple[int, ...], tuple[str, ...], list[tuple[str, dict[str, Any]]]]] = {
    "rms_norm": (
        "rms_norm",
        (16384, 4096),
        ("fwd",),
        [
            ("default (tile)", {}),
            ("tile, 4 warps", {"TUNE.fwd_warps": 4}),
            ("tile, 16 warps", {"TUNE.fwd_warps": 16}),
            ("tile, 2 rows/program", {"TUNE.fwd_tile_elems": 8192}),
            ("row", {"FWD_VARIANT": "row"}),
            ("row, 4 warps", {"FWD_VARIANT": "row", "TUNE.fwd_warps": 4}),
            ("row, 16 warps", {"FWD_VARIANT": "row", "TUNE.fwd_warps": 16}),
        ],
    ),
    # decode-sized rows: Liger's rms_norm led triton by 0.13-0.23 µs (2.4-4.4%) at <= 64 rows of
    # 4096 in CUDA-graph replays (h200-2026-12-04-serving/sweep_serving.csv); a GPU-latency gap
    "rms_norm_decode": (
        "rms_norm",
        (4, 4096),
        ("fwd",),
        [
            ("default (tile, 8 warps)", {}),
            ("tile, 4 warps", {"TUNE.fwd_warps": 4}),
            ("tile, 16 warps", {"TUNE.fwd_warps": 16}),
            ("row", {"FWD_VARIANT": "row"}),
            ("row, 4 warps", {"FWD_VARIANT": "row", "TUNE.fwd_warps": 4}),
            ("row, 16 warps", {"FWD_VARIANT": "row", "TUNE.fwd_warps": 16}),
        ],
    ),
    "fused_add_rms_norm": (
        "fused_add_rms_norm",
        (16384, 4096),
        ("fwd", "fwd+bwd"),
        [
            ("default", {}),
            ("bwd 4 programs/SM", {"TUNE.bwd_programs_per_sm": 4}),
            ("bwd warps by tile size", {"TUNE.bwd_warps": None}),
            ("bwd 32 warps", {"TUNE.bwd_warps": 32}),
            ("bwd 2 rows/program", {"TUNE.bwd_tile_elems": 8192}),
            ("fwd 16 warps", {"TUNE.fwd_warps": 16}),
        ],
    ),
    "rope": (
        "rope",
        (4, 32, 4096, 128),
        ("fwd", "fwd+bwd"),
        [
            ("default (rows kernel, 2048 elems, 4 warps)", {}),
            ("heads kernel (1024 elems, 1 warp)", {"ROWS_MIN_T": 1 << 30}),
            ("rows, 1024 elems, 2 warps", {"ROW_ELEMS": 1024, "ROW_WARPS": 2}),
            ("rows, 1024 elems, 4 warps", {"ROW_ELEMS": 1024, "ROW_WARPS": 4}),
            ("rows, 2048 elems, 8 warps", {"ROW_WARPS": 8}),
            ("rows, 4096 elems, 4 warps", {"ROW_ELEMS": 4096}),
            ("rows, 4096 elems, 8 warps", {"ROW_ELEMS": 4096, "ROW_WARPS": 8}),
            ("rows, 8192 elems, 8 warps", {"ROW_ELEMS": 8192, "ROW_WARPS": 8}),
        ],
    ),
    # gelu_and_mul (erf) at prefill: 78.7% of a copy against silu_and_mul's 98.9% and FlashInfer's
    # 85.8% (h200-2026-12-04-serving/graph-after-ranks.json): the erf's longer dependency chain may
    # want more warps in flight per byte, or smaller tiles; and d = 14336 is 3.5 tiles of 4096, so
    # the last of each row's four tiles is half masked (12.5% of the erf computed on padding),
    # where 2048 divides it
    "gelu_and_mul": (
        "gelu_and_mul",
        (8192, 28672),
        ("fwd",),
        [
            ("default (4096 elems, 16 per thread, 8 warps)", {}),
            ("4096 elems, 8 per thread, 16 warps", {"ELEMS_PER_THREAD": 8, "MAX_WARPS": 16}),
            ("4096 elems, 32 per thread, 4 warps", {"ELEMS_PER_THREAD": 32}),
            ("2048 elems, 8 warps", {"BLOCK_MAX": 2048, "ELEMS_PER_THREAD": 8}),
            ("2048 elems, 4 warps", {"BLOCK_MAX": 2048}),
            ("1024 elems, 4 warps", {"BLOCK_MAX": 1024, "ELEMS_PER_THREAD": 8}),
            ("8192 elems, 8 warps", {"BLOCK_MAX": 8192, "ELEMS_PER_THREAD": 32}),
            ("8192 elems, 16 warps", {"BLOCK_MAX": 8192, "MAX_WARPS": 16}),
        ],
    ),
}
MODULES = {"rms_norm": trms, "rms_norm_decode": trms, "fused_add_rms_norm": tfa, "rope": trope, "gelu_and_mul": tglu}


@contextlib.contextmanager
def variant(module: Any, settings: dict[str, Any]) -> Iterator[None]:
    """Apply ``settings`` to ``module`` (``TUNE.key`` for its TUNE dict), restore on exit."""
    saved: dict[str, Any] = {}
    for name, value in settings.items():
        if name.startswith("TUNE."):
            key = name[5:]
            saved[name] = module.TUNE[key]
            module.TUNE[key] = value
        else:
            saved[name] = getattr(module, name)
            setattr(module, name, value)
    _clear(module)
    try:
        yield
    finally:
        for name, value in saved.items():
            if name.startswith("TUNE."):
                module.TUNE[name[5:]] = value
            else:
                setattr(module, name, value)
        _clear(module)


def _clear(module: Any) -> None:
    for attr in ("_tiles", "_tile"):  # launch-shape caches that read module constants
        fn = getattr(module, attr, None)
        if hasattr(fn, "cache_clear"):
            fn.cache_clear()
    polykernel.clear_caches()
    from polykernel.backends.triton import _native

    _native.clear()  # the native path's plans hold tile choices read from TUNE


def _step(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], mode: str) -> Callable[[], Any]:
    public = getattr(polykernel, op.name)

    def fwd() -> Any:
        return public(*args, impl="triton", **kwargs)

    if mode == "fwd":
        return lambda: torch.no_grad()(fwd)()
    first = fwd()
    outs = [o for o in (first if isinstance(first, tuple) else (first,)) if o.requires_grad]
    inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    cots = [torch.randn_like(o) for o in outs]

    def both() -> Any:
        out = fwd()
        return torch.autograd.grad([o for o in (out if isinstance(out, tuple) else (out,)) if o.requires_grad], inputs, cots)

    return both


def run_group(name: str, sink: RowFile | None = None) -> list[dict[str, Any]]:
    """The group's rows, each kept in ``sink`` (and printed) as it is measured."""
    op_name, shape, modes, variants = GROUPS[name]
    op = registry.get_op(op_name)
    module = MODULES[name]
    rows = []
    for mode in modes:
        case = op.example(shape, torch.bfloat16, "cuda", mode == "fwd+bwd")
        nbytes = op.bytes_moved(*case.args, backward=mode == "fwd+bwd", **case.kwargs)
        for label, settings in variants:
            row: dict[str, Any] = {"group": name, "op": op_name, "shape": "x".join(map(str, shape)), "mode": mode, "variant": label}
            try:
                with variant(module, settings):
                    us = gpu_us(_step(op, case.args, case.kwargs, mode))
                row["gpu_us"], row["TB/s"] = us, nbytes / (us * 1e-6) / 1e12
            except Exception as exc:  # a variant that does not compile or run: recorded, not fatal
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            rows.append(row)
            line = f"{name:<19} {mode:<8} {label:<34} " + (
                f"{row['TB/s']:.3f} TB/s ({row['gpu_us']:.1f} us)" if "TB/s" in row else row["error"]
            )
            (sink or RowFile(None)).add(row, line)
        del case
        torch.cuda.empty_cache()
    return rows


def _kernels(step: Callable[[], Any], calls: int = 3) -> dict[str, float]:
    """GPU kernel time per call by kernel name (torch.profiler, CUPTI), microseconds."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if t and e.key and not e.key.startswith(("cudaGraph", "ProfilerStep")):
            out[e.key[:90]] = out.get(e.key[:90], 0.0) + t / calls
    return dict(sorted(out.items(), key=lambda kv: -kv[1])[:25])


def run_flce() -> dict[str, Any]:
    """Eager call vs CUDA-graph replay of the fused linear cross-entropy, fwd+bwd."""
    op = registry.get_op("fused_linear_cross_entropy")
    case = op.example((8192, 4096, 128256), torch.bfloat16, "cuda", True)
    args, kwargs = case.args, case.kwargs
    inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    result: dict[str, Any] = {}
    for cot_name, cot in (("cotangent 1", torch.ones((), device="cuda")), ("random cotangent", torch.rand((), device="cuda") + 0.5)):

        def step(cot: torch.Tensor = cot) -> Any:
            return torch.autograd.grad(polykernel.fused_linear_cross_entropy(*args, impl="triton", **kwargs), inputs, cot)

        polykernel.clear_caches()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        eager = per_call_us(step, calls=5)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        graph_us = gpu_us(step, calls=1, replays=5)
        entry = {"eager_per_call_ms": eager / 1e3, "graph_ms": graph_us / 1e3, "eager_peak_extra_MiB": peak}
        entry["eager_kernels_us"] = _kernels(step)
        graph = capture_graph(step, warmup=1)
        graph.replay()
        entry["graph_kernels_us"] = _kernels(graph.replay)
        del graph
        result[cot_name] = entry
        print(f"flce {cot_name}: eager {entry['eager_per_call_ms']:.2f} ms per call, graph {entry['graph_ms']:.2f} ms", flush=True)
    return result


def markdown(rows: list[dict[str, Any]], flce: dict[str, Any] | None, meta: dict[str, Any]) -> str:
    out = [f"# Kernel variants: {meta['device']}, torch {meta['torch']}, triton {meta['triton']}, bf16, GPU time (CUDA graph)", ""]
    out += ["| group | mode | variant | TB/s | µs |", "|---|---|---|---|---|"]
    for r in rows:
        perf = (f"{r['TB/s']:.3f}", f"{r['gpu_us']:.1f}") if "TB/s" in r else (r.get("error", ""), "")
        out.append(f"| {r['group']} | {r['mode']} | {r['variant']} | {perf[0]} | {perf[1]} |")
    if flce:
        out += ["", "## fused linear cross-entropy, N=8192 H=4096 V=128256, fwd+bwd (triton impl)", ""]
        for name, e in flce.items():
            out.append(
                f"- {name}: eager {e['eager_per_call_ms']:.2f} ms per call, CUDA graph {e['graph_ms']:.2f} ms, peak extra {e['eager_peak_extra_MiB']:.0f} MiB"
            )
        for name, e in flce.items():
            out += ["", f"### kernels per call, {name} (µs): eager | graph", "", "| kernel | eager | graph |", "|---|---|---|"]
            names = list(dict.fromkeys([*e["eager_kernels_us"], *e["graph_kernels_us"]]))
            for k in names:
                a, b = e["eager_kernels_us"].get(k), e["graph_kernels_us"].get(k)
                out.append(f"| `{k}` | {'' if a is None else f'{a:.0f}'} | {'' if b is None else f'{b:.0f}'} |")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--only", default="", help="comma-separated groups: rms_norm, rms_norm_decode, fused_add_rms_norm, rope, gelu_and_mul, flce"
    )
    a = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kernel_variants.py needs a CUDA GPU")
    only = {g for g in a.only.split(",") if g}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    import triton

    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    groups = [name for name in GROUPS if not only or name in only]
    # {"meta", "complete", "rows", "flce"}: each variant's row written as measured, flce at the end
    sink = RowFile(out / "kernel_variants.json", {"meta": meta, "flce": None})
    n = sum(len(GROUPS[g][2]) * len(GROUPS[g][3]) for g in groups)
    announce(n, per_case_s=3, what="variant rows", path=str(sink.path), extra_s=60 if not only or "flce" in only else 0)
    rows: list[dict[str, Any]] = []
    for name in groups:
        rows += run_group(name, sink)
    flce = run_flce() if (not only or "flce" in only) else None
    meta["seconds"] = round(time.time() - t0, 1)
    sink.finish(flce=flce)
    (out / "kernel_variants.md").write_text(markdown(rows, flce, meta))
    print(f"wrote {out / 'kernel_variants.md'} in {meta['seconds']} s")


if __name__ == "__main__":
    main()
