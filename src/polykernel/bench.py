"""``polykernel bench``: polykernel's impls next to eager PyTorch and torch.compile, in one process
and one run, on a CUDA GPU. The peers that are installed (Liger-Kernel, QuACK) are registered
impls (``polykernel:liger``, ``polykernel:quack``) and are measured as such.

    $ polykernel bench                          # every op, README shapes, bf16
    $ polykernel bench rms_norm softmax --graph # GPU time only (CUDA-graph replays)
    $ python benchmarks/bench_ops.py --ops rms_norm --out results/

Timing: ``triton.testing.do_bench`` medians (it flushes L2 between runs). Forward times one call;
"fwd+bwd" times a forward plus ``torch.autograd.grad`` of every output with a fixed random
cotangent. GB/s counts the fewest bytes the op must move (each op file's ``bytes_moved``: state
the formula there); the fused linear cross-entropy reports TFLOP/s from 2·N·H·V (forward) and
6·N·H·V (forward+backward). "% copy" is against a 2 GiB device-to-device copy measured at the
start of the same run (bytes read + written). Peak extra memory is reported for the losses.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# op -> list of (label, example shape). Shapes from ../shared/gpu/README.md's peer table.
SHAPES: dict[str, list[tuple[str, tuple[int, ...]]]] = {
    "rms_norm": [
        ("16384x4096", (16384, 4096)),
        ("4096x16384", (4096, 16384)),
        ("2048x65536", (2048, 65536)),
        ("512x262144", (512, 262144)),
    ],
    "fused_add_rms_norm": [("16384x4096", (16384, 4096))],
    "layer_norm": [("16384x4096", (16384, 4096))],
    "swiglu": [("16384x14336", (16384, 14336))],
    "geglu": [("16384x14336", (16384, 14336))],
    "softmax": [("8192x32768", (8192, 32768))],
    "rope": [("q4x32x4096x128,k8", (4, 32, 4096, 128))],
    "cross_entropy": [("8192x128256", (8192, 128256))],
    "fused_linear_cross_entropy": [("N8192,H4096,V128256", (8192, 4096, 128256))],
}


def copy_bandwidth() -> float:
    import torch
    import triton.testing

    src = torch.randn(2**30, dtype=torch.bfloat16, device="cuda")  # 2 GiB
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")
    return 2 * 2**31 / (ms * 1e-3) / 1e9


def _outputs(out: Any) -> list[torch.Tensor]:
    import torch

    return [o for o in (out if isinstance(out, tuple) else (out,)) if isinstance(o, torch.Tensor) and o.requires_grad]


def measure(fn: Callable[[], Any], grad_inputs: list[torch.Tensor], backward: bool, graph: bool = False) -> tuple[float, float]:
    """(median ms, peak extra MiB) of fn (forward) or fn + autograd.grad (forward+backward).

    ``graph=True`` captures the step in a CUDA graph and times its replays: GPU time alone, with
    the host's launch cost (Python, autograd, Triton's launcher) taken out.
    """
    import torch
    import triton.testing

    if backward:
        cots = [torch.randn_like(o) for o in _outputs(fn())]

        def step() -> Any:
            return torch.autograd.grad(_outputs(fn()), grad_inputs, cots)

    else:

        def step() -> Any:
            with torch.no_grad():
                return fn()

    step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    if graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            step()
        ms = triton.testing.do_bench(captured.replay, warmup=25, rep=100, return_mode="median")
    else:
        ms = triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median")
    return ms, peak


def _contenders(
    op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], dtype: torch.dtype, use_compile: bool
) -> dict[str, Callable[[], Any]]:
    """Name -> a no-argument call of one contender on the same inputs."""
    import torch

    import polykernel

    public = getattr(polykernel, op.name)
    out: dict[str, Callable[[], Any]] = {}
    # Every registered impl runnable here, the peers included (impl="liger", impl="quack"): a peer
    # is measured through its adapter, as polykernel runs it. An impl whose predicate refuses these
    # arguments (Liger at N > 65536) raises ImplNotAvailableError: its row records the reason.
    for impl in polykernel.available_impls(op.id, device="cuda", dtype=dtype):
        out[f"polykernel:{impl}"] = lambda impl=impl: public(*args, impl=impl, **kwargs)
    out["eager reference"] = lambda: op.reference(*args, **kwargs)
    if use_compile:
        compiled = torch.compile(op.reference, dynamic=False)
        out["torch.compile"] = lambda: compiled(*args, **kwargs)
    return out


def run(ops: list[str], use_compile: bool, dtype: torch.dtype, graph: bool = False) -> tuple[list[dict[str, Any]], float]:
    import torch

    from polykernel import registry

    copy = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | copy 2 GiB: {copy:.0f} GB/s", flush=True)
    rows: list[dict[str, Any]] = []
    for name in ops:
        op = registry.get_op(name)
        for label, shape in SHAPES[op.name]:
            case = op.example(shape, dtype, "cuda", True)
            args, kwargs = case.args, case.kwargs
            grad_inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
            contenders = _contenders(op, args, kwargs, dtype, use_compile)
            for who, fn in contenders.items():
                for backward in (False, True):
                    t0 = time.time()
                    try:
                        ms, peak = measure(fn, grad_inputs, backward, graph)
                        err = ""
                    except Exception as exc:
                        ms, peak, err = float("nan"), float("nan"), f"{type(exc).__name__}: {str(exc)[:120]}"
                    row = {
                        "op": op.name,
                        "shape": label,
                        "dtype": str(dtype).removeprefix("torch."),
                        "mode": ("fwd+bwd" if backward else "fwd") + (" graph" if graph else ""),
                        "impl": who,
                        "ms": ms,
                        "peak_extra_MiB": peak,
                        "error": err,
                    }
                    if op.name == "fused_linear_cross_entropy":
                        n, h, v = shape
                        row["TFLOP/s"] = (6 if backward else 2) * n * h * v / (ms * 1e-3) / 1e12
                    elif op.bytes_moved is not None:
                        gbs = op.bytes_moved(*args, backward=backward, **kwargs) / (ms * 1e-3) / 1e9
                        row["GB/s"], row["% copy"] = gbs, 100 * gbs / copy
                    rows.append(row)
                    print(_fmt(row), f"[{time.time() - t0:.1f}s]", flush=True)
            torch.cuda.empty_cache()
    return rows, copy


def _fmt(r: dict[str, Any]) -> str:
    perf = (
        f"{r['TFLOP/s']:7.1f} TFLOP/s"
        if "TFLOP/s" in r
        else f"{r.get('GB/s', float('nan')):7.0f} GB/s ({r.get('% copy', float('nan')):5.1f}% copy)"
    )
    return f"{r['op']:<27} {r['shape']:<20} {r['mode']:<8} {r['impl']:<18} {r['ms']:9.3f} ms {perf} peak+{r['peak_extra_MiB']:8.0f} MiB {r['error']}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("op", nargs="*", help="ops to measure (default: all)")
    p.add_argument("--ops", default="", help="comma-separated ops (same as the positional list)")
    p.add_argument("--out", default=os.environ.get("OUT", "results"))
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--graph", action="store_true", help="time CUDA-graph replays (GPU time without host launch cost)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON at the end")


def run_cli(a: argparse.Namespace) -> int:
    import torch

    from polykernel import registry

    if not torch.cuda.is_available():
        print("polykernel bench needs a CUDA GPU", file=sys.stderr)
        return 2
    names = [*a.op, *(o for o in a.ops.split(",") if o)] or list(SHAPES)
    ops = [registry.get_op(o).name for o in names]
    rows, copy = run(ops, not a.no_compile, getattr(torch, a.dtype), a.graph)
    os.makedirs(a.out, exist_ok=True)
    stem = "bench-graph" if a.graph else "bench"
    with open(os.path.join(a.out, f"{stem}.json"), "w") as f:
        json.dump(
            {
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "copy_GBps": copy,
                "date": time.strftime("%Y-%m-%d"),
                "rows": rows,
            },
            f,
            indent=1,
        )
    keys = sorted({k for r in rows for k in r}, key=lambda k: list(rows[0]).index(k) if k in rows[0] else 99)
    with open(os.path.join(a.out, f"{stem}.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    if a.json:
        print(json.dumps(rows, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run_cli(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
