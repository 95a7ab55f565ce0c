"""One MoE experts layer, forward+backward: polykernel's impls against transformers' experts (issue 24).

Shapes (bf16): Qwen3-30B-A3B (T=8192, H=2048, I=768, E=128, k=8) and Mixtral (T=8192, H=4096,
I=14336, E=8, k=2), a softmax top-k routing. Contenders on the same tensors: each runnable impl
of ``polykernel.moe_experts`` (``polykernel:torch``, ``:triton``, ``:liger`` — Liger's
``LigerFusedMoEFunction`` through its adapter — and the automatic choice), transformers'
``grouped_mm`` experts implementation and its eager loop (``Qwen3MoeExperts.forward``). Per row:
the median fwd+bwd (and fwd) time, TFLOP/s of the routed work (18·S·H·I fwd+bwd, 6·S·H·I fwd;
S = T·k) and its share of a bf16 GEMM rate measured in the same run (an 8192³ ``torch.mm``), the
speedup over each transformers baseline, and the peak extra memory. ``--gpt-oss`` adds
``moe_experts_gpt_oss`` at gpt-oss-20b's expert shapes (T=8192, H=2880, I=2880, E=32, k=4)
against transformers' eager ``GptOssExperts``.

    PYTHONPATH=src python benchmarks/kernels/moe.py --json moe.json              # H200, ~2-4 min
    PYTHONPATH=src python benchmarks/kernels/moe.py --json moe.json --gpt-oss
    PYTHONPATH=src python benchmarks/kernels/moe.py --tiny --device cpu --json /tmp/moe.json   # smoke test

The eager loop at Qwen3 shapes (128 experts, a host sync each) takes seconds per step: it is
skipped above ``--eager-max-experts`` (32; its row says so), and ``--rep`` bounds the repetitions
(time-based on the GPU, count-based on the CPU). Each row is printed and written to ``--json`` as
soon as it is measured (``polykernel.tools.rows``): a run cut at its time limit keeps them.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import polykernel
from polykernel.ops import moe_experts as op
from polykernel.ops import moe_experts_gpt_oss as oss_op
from polykernel.tools.rows import RowFile, announce

SHAPES = {
    "qwen3-30b-a3b": (8192, 2048, 768, 128, 8),
    "mixtral-8x7b": (8192, 4096, 14336, 8, 2),
}
TINY = {"qwen3-like": (64, 64, 32, 16, 4), "mixtral-like": (32, 64, 128, 4, 2)}
GPT_OSS = {"gpt-oss-20b": (8192, 2880, 2880, 32, 4)}
GPT_OSS_TINY = {"gpt-oss-like": (32, 64, 64, 4, 2)}


def timed(fn: Callable[[], Any], device: str, rep_ms: int) -> float:
    """Median ms of ``fn``: triton's do_bench on the GPU (L2 flushed between reps), else a few
    wall-clock reps."""
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=max(rep_ms // 10, 5), rep=rep_ms, return_mode="median")
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def gemm_tflops(device: str, dtype: torch.dtype, n: int, rep_ms: int) -> float:
    """The device's measured dense GEMM rate for ``dtype`` (an n x n x n ``torch.mm``)."""
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / (timed(lambda: torch.mm(a, b), device, rep_ms) * 1e-3) / 1e12


def peak_mib(step: Callable[[], Any], device: str) -> float | None:
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def hf_experts(args: tuple[torch.Tensor, ...]) -> dict[str, Callable[[], torch.Tensor]]:
    """transformers' grouped_mm experts implementation and eager loop on the same tensors."""
    from polykernel.tools.bench import transformers_experts

    return transformers_experts(args, {})


def hf_gpt_oss(args: tuple[torch.Tensor, ...]) -> dict[str, Callable[[], torch.Tensor]]:
    """transformers' GptOssExperts (eager loop, grouped_mm) on the same tensors."""
    from polykernel.tools.bench import transformers_gpt_oss_experts

    return transformers_gpt_oss_experts(args, {})


# transformers' eager loop costs a host sync and a few launches per expert: at Qwen3's 128 experts
# a step takes seconds, and timing it took most of a 190 s device command before any row printed.
EAGER_MAX_EXPERTS = 32


def rows_for(
    name: str,
    shape: tuple[int, ...],
    gpt_oss: bool,
    device: str,
    dtype: torch.dtype,
    rep_ms: int,
    gemm: float,
    sink: RowFile | None = None,
    eager_max_experts: int = EAGER_MAX_EXPERTS,
) -> list[dict[str, Any]]:
    module = oss_op if gpt_oss else op
    public = polykernel.moe_experts_gpt_oss if gpt_oss else polykernel.moe_experts
    torch.manual_seed(0)
    case = module.example(shape, dtype, device, requires_grad=True)
    args = case.args
    leaves = [a for a in args if a.is_floating_point() and a.requires_grad]
    contenders: dict[str, Callable[[], torch.Tensor]] = {"polykernel": lambda: public(*args)}
    for impl in polykernel.available_impls(module.OP_ID, device=device, dtype=dtype):
        contenders[f"polykernel:{impl}"] = lambda impl=impl: public(*args, impl=impl)
    contenders.update(hf_gpt_oss(args) if gpt_oss else hf_experts(args))
    rows = []
    for who, fn in contenders.items():
        row: dict[str, Any] = {"case": name, "shape": "T{},H{},I{},E{},k{}".format(*shape), "contender": who}
        if who == "transformers eager" and shape[3] > eager_max_experts:
            row["error"] = f"skipped: {shape[3]} experts > --eager-max-experts {eager_max_experts} (a host sync per expert)"
            rows.append(sink.add(row, line_for(row)) if sink else row)
            continue
        try:
            out = fn()
            dy = torch.randn_like(out)

            def step(fn: Callable[[], torch.Tensor] = fn, dy: torch.Tensor = dy) -> Any:
                return torch.autograd.grad(fn(), leaves, dy)

            row["fwd_ms"] = timed(lambda fn=fn: torch.no_grad()(fn)(), device, rep_ms)
            row["fwd_bwd_ms"] = timed(step, device, rep_ms)
            row["peak_mib"] = peak_mib(step, device)
            for mode, backward in (("fwd", False), ("fwd_bwd", True)):
                tf = module.flops(*args, backward=backward) / (row[f"{mode}_ms"] * 1e-3) / 1e12
                row[f"{mode}_tflops"] = tf
                row[f"{mode}_pct_gemm"] = 100 * tf / gemm
        except Exception as exc:  # an impl refusing these arguments, out of memory: the row says why
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        rows.append(sink.add(row, line_for(row)) if sink else row)  # written and printed now
        if device == "cuda":
            torch.cuda.empty_cache()
    # speedups over the baselines measured in this case (the file gets them with the next write)
    for base in ("transformers grouped_mm", "transformers eager"):
        ref = next((r for r in rows if r["contender"] == base and "fwd_bwd_ms" in r), None)
        if ref is None:
            continue
        for r in rows:
            if "fwd_bwd_ms" in r:
                r[f"speedup_vs_{base.split()[1]}"] = ref["fwd_bwd_ms"] / r["fwd_bwd_ms"]
    return rows


def line_for(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"{row['case']:16} {row['contender']:26} {row['error']}"
    return (
        f"{row['case']:16} {row['contender']:26} fwd+bwd {row['fwd_bwd_ms']:9.3f} ms {row['fwd_bwd_tflops']:7.1f} TFLOP/s "
        f"({row['fwd_bwd_pct_gemm']:5.1f}% GEMM)  fwd {row['fwd_ms']:8.3f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows and the environment here")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--tiny", action="store_true", help="small shapes (a CPU smoke test)")
    parser.add_argument("--gpt-oss", action="store_true", help="also moe_experts_gpt_oss at gpt-oss-20b's shapes")
    parser.add_argument("--only", help="comma-separated case names")
    parser.add_argument("--rep", type=int, default=200, help="ms of timing per measurement on the GPU")
    parser.add_argument(
        "--eager-max-experts",
        type=int,
        default=EAGER_MAX_EXPERTS,
        help="skip transformers' eager loop above this many experts (its row says so)",
    )
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    cases = [(n, s, False) for n, s in (TINY if args.tiny else SHAPES).items()]
    if args.gpt_oss:
        cases += [(n, s, True) for n, s in (GPT_OSS_TINY if args.tiny else GPT_OSS).items()]
    if args.only:
        keep = set(args.only.split(","))
        cases = [c for c in cases if c[0] in keep]
    # per case: ~6 contenders x (fwd, fwd+bwd, memory) x --rep ms, plus first calls (Triton compiles)
    announce(len(cases), 8 * 3 * args.rep / 1e3 + 20, "cases", args.json)
    gemm = gemm_tflops(args.device, dtype, 256 if args.tiny else 8192, args.rep)
    print(f"measured {args.dtype} GEMM rate: {gemm:.1f} TFLOP/s")
    out = RowFile(args.json, {"env": environment(args, gemm)})
    for name, shape, oss in cases:
        rows_for(name, shape, oss, args.device, dtype, args.rep, gemm, out, args.eager_max_experts)
    out.finish()


def environment(args: argparse.Namespace, gemm: float) -> dict[str, Any]:
    env = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "polykernel": getattr(polykernel, "__version__", None),
        "dtype": args.dtype,
        "gemm_tflops": gemm,
    }
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    return env


if __name__ == "__main__":
    main()
