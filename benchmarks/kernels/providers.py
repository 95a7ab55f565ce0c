"""The issue-25 providers on the H200: cuda_jit and torch_compile against our Triton and the peers.

    PYTHONPATH=src python benchmarks/kernels/providers.py --json benchmarks/results/h200-providers.json

Rows (bf16, forward; GPU time of CUDA-graph replays unless ``--eager``, ``do_bench`` medians):

- ``rms_norm`` at 16384x4096: impl="cuda_jit" | "triton" | "liger" | "quack" | "cute_dsl" |
  "torch_compile" | "torch", and ``torch.compile`` of the reference; TB/s over 2·M·N·2 bytes (x
  read, y written) against the device-to-device copy measured in the same run (issue 25's target:
  cuda_jit >= 3.95 TB/s);
- ``fused_add_rms_norm_`` (serving, in place) at 16384x4096: cuda_jit | triton | torch, over
  4·M·N·2 bytes (x and residual read and written);
- ``rope`` at the README shape (q 4x32x4096x128, k 8 heads): impl="torch_compile" | "triton" |
  "torch", over the op's ``bytes_moved``.

Each impl's first call (the cuda_jit build, the torch.compile compile) is timed separately
(``first_s``) and excluded from the medians. An impl that cannot run a case gets its reason. CPU
smoke test (tiny shapes, wall time): ``--device cpu --rows 64 --n 256 --rope 1x2x16x32``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import polykernel
from polykernel import timing
from polykernel.core import registry
from polykernel.testing import refusal
from polykernel.tools.rows import RowFile, announce

NORM_IMPLS = ("cuda_jit", "triton", "liger", "quack", "cute_dsl", "torch_compile", "torch")
FUSED_IMPLS = ("cuda_jit", "triton", "torch")
ROPE_IMPLS = ("torch_compile", "triton", "torch")
TARGET_TBS = 3.95  # issue 25: cuda_jit rms_norm forward at 16384x4096


def _time(step: Callable[[], Any], device: str, graph: bool, rep: int) -> float:
    """Median ms of ``step`` (already warm)."""
    if device != "cuda":
        samples = []
        for _ in range(max(3, rep // 10)):
            t0 = time.perf_counter()
            step()
            samples.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(samples)
    if graph:
        return timing.do_bench(timing.capture_graph(step).replay, warmup=25, rep=rep)
    return timing.do_bench(step, warmup=25, rep=rep)


def _copy_tbs(device: str, nbytes: int) -> float:
    if device == "cuda":
        return timing.copy_bandwidth() / 1e3
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = _time(lambda: dst.copy_(src), device, False, 50)
    return nbytes / (ms * 1e-3) / 1e12


def _run(op_name: str, label: str, step: Callable[[], Any], nbytes: int, device: str, graph: bool, rep: int, copy: float) -> dict[str, Any]:
    row: dict[str, Any] = {"op": op_name, "impl": label}
    try:
        with torch.no_grad():
            t0 = time.perf_counter()
            step()  # the first call: a build or a compile, timed apart
            if device == "cuda":
                torch.cuda.synchronize()
            row["first_s"] = round(time.perf_counter() - t0, 3)
            ms = _time(step, device, graph, rep)
        row.update(ms=ms, tbs=nbytes / (ms * 1e-3) / 1e12)
        row["pct_copy"] = 100 * row["tbs"] / copy
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    return row


def bench(device: str, rows: int, n: int, rope_shape: tuple[int, ...], graph: bool, rep: int, path: str | None = None) -> dict[str, Any]:
    """The rows, each written to ``path`` and printed as soon as it is measured (a cut run keeps them)."""
    dtype = torch.bfloat16
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device == "cuda" else device,
        "torch": torch.__version__,
        "mode": "fwd graph" if graph and device == "cuda" else "fwd",
        "dtype": "bfloat16",
        "target_tbs": TARGET_TBS,
    }
    rf = RowFile(path, out)
    out = rf.header
    announce(12, 3 + 3 * rep / 1e3, "rows (about)", path)  # each: a first call (a build, a compile) and do_bench
    norm_bytes = 2 * rows * n * 2  # x read, y written (the weight is noise at this size)
    copy = _copy_tbs(device, norm_bytes)
    out["copy_tbs"] = copy
    print(f"# {out['device']} | torch {torch.__version__} | copy {copy:.3f} TB/s", flush=True)

    x = torch.randn(rows, n, device=device, dtype=dtype)
    w = (1 + 0.1 * torch.randn(n, device=device)).to(dtype)
    shape = f"{rows}x{n}"
    norm = registry.get_op("rms_norm")
    for impl in NORM_IMPLS:
        why = (
            refusal("rms_norm", impl, norm.example((rows, n), dtype, device))
            if impl in registry.specs_for("rms_norm")
            else "not registered"
        )
        if why is not None:
            rf.add({"op": "rms_norm", "shape": shape, "impl": impl, "skipped": why})
            continue
        rf.add(
            {
                "shape": shape,
                **_run("rms_norm", impl, lambda impl=impl: polykernel.rms_norm(x, w, impl=impl), norm_bytes, device, graph, rep, copy),
            }
        )
    compiled = torch.compile(norm.reference)
    rf.add({"shape": shape, **_run("rms_norm", "torch.compile(reference)", lambda: compiled(x, w), norm_bytes, device, graph, rep, copy)})

    r = torch.randn_like(x)
    xs, rs = x.clone(), r.clone()
    for impl in FUSED_IMPLS:
        ex = registry.get_op("fused_add_rms_norm_").example((rows, n), dtype, device)
        why = refusal("fused_add_rms_norm_", impl, ex) if impl in registry.specs_for("fused_add_rms_norm_") else "not registered"
        if why is not None:
            rf.add({"op": "fused_add_rms_norm_", "shape": shape, "impl": impl, "skipped": why})
            continue
        step = lambda impl=impl: polykernel.fused_add_rms_norm_(xs, rs, w, impl=impl)  # rewrites its inputs, as an engine does
        rf.add({"shape": shape, **_run("fused_add_rms_norm_", impl, step, 2 * norm_bytes, device, graph, rep, copy)})

    rope = registry.get_op("rope")
    case = rope.example(rope_shape, dtype, device)
    rope_bytes = rope.bytes_moved(*case.args)
    label = "x".join(map(str, rope_shape))
    for impl in ROPE_IMPLS:
        why = refusal("rope", impl, case)
        if why is not None:
            rf.add({"op": "rope", "shape": label, "impl": impl, "skipped": why})
            continue
        rf.add(
            {
                "shape": label,
                **_run("rope", impl, lambda impl=impl: polykernel.rope(*case.args, impl=impl), rope_bytes, device, graph, rep, copy),
            }
        )
    rf.finish()
    return {**rf.header, "rows": rf.rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", required=True, help="where to write the results")
    p.add_argument("--device", default="cuda")
    p.add_argument("--rows", type=int, default=16384)
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--rope", default="4x32x4096x128", help="q shape B x Hq x T x D")
    p.add_argument("--eager", action="store_true", help="time eager calls instead of CUDA-graph replays")
    p.add_argument("--rep", type=int, default=200, help="do_bench's rep (ms)")
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device (use --device cpu for a smoke test)", file=sys.stderr)
        return 2
    result = bench(a.device, a.rows, a.n, tuple(int(v) for v in a.rope.split("x")), not a.eager, a.rep, a.json)
    jit = [r for r in result["rows"] if r["op"] == "rms_norm" and r["impl"] == "cuda_jit" and "tbs" in r]
    if jit:
        print(f"cuda_jit rms_norm: {jit[0]['tbs']:.3f} TB/s ({jit[0]['pct_copy']:.1f}% of copy; target {TARGET_TBS} TB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
