"""MoE experts on the H200: where the time goes, path by path (issue 33).

For each shape (bf16, a softmax top-k routing), on the same tensors: ``polykernel:triton`` (the
``torch._grouped_mm`` path, the GPU default), ``polykernel:triton[kernels]`` (our own grouped
GEMMs), ``polykernel:torch``, the automatic choice, and transformers' ``grouped_mm`` experts
(and its eager loop where E <= 32: at 128 experts it is a host sync per expert). Per row: median
fwd and fwd+bwd ms (``triton.testing.do_bench``), TFLOP/s of the routed work (6·S·H·I forward,
18·S·H·I fwd+bwd, S = T·k) and its share of an 8192³ bf16 ``torch.mm`` measured in the same run,
the speedup over transformers' grouped_mm, and the fwd+bwd peak memory beyond the inputs.
``--profile`` adds, per contender at each shape, the CUDA kernel time of one fwd+bwd by kernel
(torch.profiler): the breakdown that says whether the GEMMs or the rest cost.

Every row is printed and appended to ``--jsonl`` as soon as it is measured, so a run cut at its
limit keeps what it measured.

    PYTHONPATH=src python benchmarks/kernels/moe_paths.py --jsonl moe.jsonl --profile    # H200, ~3 min
    PYTHONPATH=src python benchmarks/kernels/moe_paths.py --sweep --jsonl sweep.jsonl   # the sweep, ~4 min
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import polykernel
from polykernel.backends.triton import _grouped_mm
from polykernel.ops import moe_experts as op
from polykernel.ops import moe_experts_gpt_oss as oss_op
from polykernel.tools.bench import transformers_experts, transformers_gpt_oss_experts

SHAPES = {  # (T, H, I, E, k)
    "qwen3-30b-a3b": (8192, 2048, 768, 128, 8),
    "mixtral-8x7b": (8192, 4096, 14336, 8, 2),
}
GPT_OSS = {"gpt-oss-20b": (8192, 2880, 2880, 32, 4)}
# tokens 512..32768, experts 8..256, top-k 1..8, widths from gpt-oss-20b's to Mixtral's
SWEEP = [
    (512, 2048, 768, 128, 8),
    (2048, 2048, 768, 128, 8),
    (32768, 2048, 768, 128, 8),
    (4096, 2048, 1408, 64, 6),
    (4096, 7168, 2048, 256, 8),
    (8192, 4096, 14336, 8, 1),
    (2048, 4096, 14336, 8, 2),
    (16384, 4096, 14336, 8, 2),
    (8192, 2880, 2880, 32, 1),
    (4096, 4096, 1536, 16, 4),
]


def emit(path: Path | None, row: dict[str, Any]) -> None:
    print(json.dumps(row), flush=True)
    if path is not None:
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")


def bench(fn: Callable[[], Any], rep_ms: int) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=max(rep_ms // 5, 25), rep=rep_ms, return_mode="median")


def contenders(gpt_oss: bool, args: tuple[torch.Tensor, ...], eager: bool) -> dict[str, Callable[[], torch.Tensor]]:
    public = polykernel.moe_experts_gpt_oss if gpt_oss else polykernel.moe_experts

    def forced(mode: str) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            old, _grouped_mm.MODE = _grouped_mm.MODE, mode
            try:
                return public(*args, impl="triton")
            finally:
                _grouped_mm.MODE = old

        return run

    out: dict[str, Callable[[], torch.Tensor]] = {
        "polykernel": lambda: public(*args),
        "polykernel:triton": forced("auto"),
        "polykernel:triton[kernels]": forced("kernels"),
        "polykernel:torch": lambda: public(*args, impl="torch"),
    }
    hf = transformers_gpt_oss_experts(args, {}) if gpt_oss else transformers_experts(args, {})
    out.update({k: v for k, v in hf.items() if eager or "eager" not in k})
    return out


def kernel_breakdown(step: Callable[[], Any]) -> dict[str, float]:
    """CUDA time (ms) by kernel name of one call of ``step`` (top 8, the rest summed)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            name = evt.name[:70]
            times[name] = times.get(name, 0.0) + evt.device_time / 1e3
    top = dict(sorted(times.items(), key=lambda kv: -kv[1])[:8])
    top["(rest)"] = round(sum(times.values()) - sum(top.values()), 4)
    top["(total)"] = round(sum(times.values()), 4)
    return {k: round(v, 4) for k, v in top.items()}


def run_shape(
    name: str, shape: tuple[int, ...], gpt_oss: bool, rep_ms: int, gemm: float, profile_it: bool, out: Path | None, dtype: torch.dtype
) -> None:
    module = oss_op if gpt_oss else op
    torch.manual_seed(0)
    case = module.example(shape, dtype, "cuda", requires_grad=True)
    args = case.args
    leaves = [a for a in args if a.is_floating_point() and a.requires_grad]
    t, h, inter, e, k = shape
    flops_fwd = 6 * t * k * h * inter
    base = None
    for who, fn in contenders(gpt_oss, args, eager=e <= 32).items():
        row: dict[str, Any] = {
            "case": name,
            "dtype": str(dtype).removeprefix("torch."),
            "shape": "T{},H{},I{},E{},k{}".format(*shape),
            "contender": who,
        }
        t0 = time.perf_counter()
        try:
            y = fn()
            dy = torch.randn_like(y)
            del y

            def step(fn: Callable[[], torch.Tensor] = fn, dy: torch.Tensor = dy) -> Any:
                return torch.autograd.grad(fn(), leaves, dy)

            with torch.no_grad():
                row["fwd_ms"] = round(bench(fn, rep_ms), 4)
            row["fwd_bwd_ms"] = round(bench(step, rep_ms), 4)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            row["peak_extra_mib"] = round((torch.cuda.max_memory_allocated() - before) / 2**20, 1)
            row["fwd_tflops"] = round(flops_fwd / row["fwd_ms"] / 1e9, 1)
            row["fwd_bwd_tflops"] = round(3 * flops_fwd / row["fwd_bwd_ms"] / 1e9, 1)
            row["fwd_bwd_of_gemm_rate"] = round(row["fwd_bwd_tflops"] / gemm, 3)
            if who == "polykernel":
                row["chose"] = next(
                    (d["impl"] for d in reversed(polykernel.decisions()) if d["op"] == module.OP_ID and d["source"] == "auto"), None
                )
            if who.startswith("transformers grouped_mm"):
                base = row
            if profile_it and "eager" not in who:
                row["kernels_ms"] = kernel_breakdown(step)
        except Exception as exc:  # one failing contender never stops the others
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        row["wall_s"] = round(time.perf_counter() - t0, 1)
        emit(out, row)
        torch.cuda.empty_cache()
    if base is not None:
        emit(
            out, {"case": name, "note": "speedups are over transformers grouped_mm's row above", "base_fwd_bwd_ms": base.get("fwd_bwd_ms")}
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jsonl", type=Path)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="the sweep's shapes instead of the three model shapes")
    parser.add_argument("--only", default="", help="comma-separated shape names (sweep points by their T-H-I-E-k name)")
    parser.add_argument("--rep", type=int, default=300, help="do_bench's rep (ms) per timing")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    a = parser.parse_args()
    if a.jsonl:
        a.jsonl.parent.mkdir(parents=True, exist_ok=True)
    n = 8192
    x, w = torch.randn(n, n, device="cuda", dtype=torch.bfloat16), torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    gemm = 2 * n**3 / bench(lambda: torch.mm(x, w), 300) / 1e9

    emit(a.jsonl, {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "bf16_gemm_tflops": round(gemm, 1)})
    jobs: list[tuple[str, tuple[int, ...], bool]]
    if a.sweep:
        jobs = [("sweep-T{}-H{}-I{}-E{}-k{}".format(*s), s, False) for s in SWEEP]
    else:
        jobs = [(k, v, False) for k, v in SHAPES.items()] + [(k, v, True) for k, v in GPT_OSS.items()]
    if a.only:
        jobs = [j for j in jobs if j[0] in a.only.split(",")]
    print(f"# {len(jobs)} shapes, ~{20 * len(jobs)} s each", flush=True)
    for name, shape, gpt_oss in jobs:
        run_shape(name, shape, gpt_oss, a.rep, gemm, a.profile, a.jsonl, getattr(torch, a.dtype))


if __name__ == "__main__":
    main()
