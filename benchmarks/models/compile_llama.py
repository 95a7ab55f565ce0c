"""Training step of a Llama (1.x B, vocab 128256) with and without polykernel, eager and compiled.

Reproduces issue 14's table on one GPU: a ``transformers`` Llama (hidden 2048, 16 layers, 32/8
heads, vocab 128256, tied embeddings; ``polykernel.tools.models.llama`` when transformers is absent),
bf16, fused AdamW, batch 4 x 2048, each variant in its own subprocess (fresh allocator, fresh
compile caches). Per variant: tokens/s from the median step time of steps 4..N, peak memory, and
the compile time (the first step's time; also the first three steps' sum).

    PYTHONPATH=src python benchmarks/models/compile_llama.py --out DIR              # 4 variants, ~4-5 min
    PYTHONPATH=src python benchmarks/models/compile_llama.py --out DIR --all-modes  # + max-autotune-no-cudagraphs, reduce-overhead
    PYTHONPATH=src python benchmarks/models/compile_llama.py --out DIR --only compile,compile[is_causal],polykernel[ops]+compile,polykernel+compile

The last isolates the causal mask: transformers materializes it under compile (5.17 always; 5.24
with a torch before pytorch#176499) where eager skips it; ``patch``'s ``sdpa_is_causal`` switch skips it
under compile too (``[is_causal]``: that switch alone; ``polykernel[ops]``: the ops without it).

Writes ``DIR/compile_llama.json`` (``env``, ``args``, ``complete`` and ``rows``: one record per
variant, written as each variant ends; ``results`` before issue 35) and prints a table. ``--profile`` also profiles two steady steps per variant (torch.profiler, CUDA): the GPU
time by kernel family goes into the record (where the time goes: GEMMs, attention, Inductor's
Triton kernels, polykernel's kernels, copies) and the top kernels into ``DIR/profile-<variant>.txt``.
``--memory`` records one more steady step's allocations: the step's peak over its start and the
largest allocations alive at that peak, with the frame that made each (Inductor's generated code
under compile), into ``DIR/memory-<variant>.txt`` (what a compiled peak above eager's holds).
``--steps`` (default 10) sets N; ``--layers``/``--batch``/``--seq`` shrink the model.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from _child import last_error_line, parse, run_child
from _common import allocation_site, allocator_events, by_site, llama_config, peak_allocations, timed_steps

from polykernel.tools.rows import RowFile, announce

# name -> (what polykernel patches, torch.compile mode: None = eager, "default" = compile(model)).
# Patches: None; "all" = patch(model); "ops" = the ops only, transformers builds the causal mask
# under compile as before (patch(model, sdpa_is_causal=False)); "mask" = only SDPA's is_causal
# under compile, no op of ours (isolates what the materialized mask costs plain torch.compile).
VARIANTS = {
    "plain": (None, None),
    "compile": (None, "default"),
    "polykernel": ("all", None),
    "polykernel+compile": ("all", "default"),
}
EXTRA = {
    "compile[is_causal]": ("mask", "default"),
    "polykernel[ops]+compile": ("ops", "default"),
    "compile[max-autotune-no-cudagraphs]": (None, "max-autotune-no-cudagraphs"),
    "polykernel+compile[max-autotune-no-cudagraphs]": ("all", "max-autotune-no-cudagraphs"),
    "compile[reduce-overhead]": (None, "reduce-overhead"),
    "polykernel+compile[reduce-overhead]": ("all", "reduce-overhead"),
}
PATCH_SWITCHES = {
    "all": {},
    "ops": {"sdpa_is_causal": False},
    "mask": dict.fromkeys(("rms_norm", "swiglu", "rope", "cross_entropy", "fused_linear_cross_entropy"), False),
}


def _build(args: argparse.Namespace, patch: str | None) -> tuple[Any, Any, str]:
    """The model on the GPU in bf16 and a ``step_loss(ids)`` for it; which implementation built it."""
    import torch

    try:
        import transformers
    except ImportError:
        transformers = None
    if transformers is not None and not args.builtin:
        cfg = llama_config(args)  # vocab 128256, 32/8 heads
        with torch.device("cuda"):
            model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
        if patch is not None:
            from polykernel.integrations.transformers import patch as pk_patch

            pk_patch(model, **PATCH_SWITCHES[patch])
        return model, lambda m, ids: m(input_ids=ids, labels=ids).loss, f"transformers {transformers.__version__}"
    from polykernel.tools.models import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=128256,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_layers=args.layers,
        num_heads=32,
        num_kv_heads=8,
        max_seq_len=max(args.seq, 2048),
        norm_casting="llama",
        tie_embeddings=True,
    )
    model = LlamaForCausalLM(cfg, device="cuda").to(torch.bfloat16)
    model.use_polykernel = patch in ("all", "ops")  # no causal-mask question here: it calls SDPA with is_causal
    return model, lambda m, ids: m(ids[:, :-1], targets=ids[:, 1:]), "polykernel.tools.models.llama"


# kernel-name patterns -> family, first match wins (for --profile's breakdown); Inductor's
# kernels are named triton_*, ours start with an underscore
FAMILIES = (
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("gemm", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas", "matmul", "_mm_", "mm_kernel")),
    ("inductor", ("triton_",)),
    ("polykernel", ("_add_rms_", "_rms_", "_ln_", "_glu_", "_rope_kernel", "_softmax_", "_ce_kernel", "_colsum_kernel", "quack")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("copy/fill", ("copy", "memcpy", "memset", "fill", "cat", "elementwise")),
)


def _family(name: str) -> str:
    low = name.lower()
    return next((fam for fam, keys in FAMILIES if any(k in low for k in keys)), "other")


def _profile(run_step: Any, out: Path, variant: str) -> dict[str, Any]:
    """Two steady steps under torch.profiler: GPU ms per kernel family (per step) and the top kernels."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            run_step()
        torch.cuda.synchronize()
    families: dict[str, float] = {}
    kernels = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        us = e.self_cuda_time_total if us is None else us
        if us <= 0:
            continue
        fam = _family(e.key)
        families[fam] = families.get(fam, 0.0) + us / 2e3  # ms per step
        kernels.append((us / 2e3, e.count // 2, fam, e.key))
    kernels.sort(reverse=True)
    lines = [
        f"{variant}: GPU ms per step by family: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(families.items(), key=lambda kv: -kv[1]))
    ]
    lines += [f"{ms:9.3f} ms {n:5d}x  {fam:<10} {name[:140]}" for ms, n, fam, name in kernels[:60]]
    (out / f"profile-{variant.replace('+', '_plus_').replace('[', '-').replace(']', '')}.txt").write_text("\n".join(lines) + "\n")
    return {"gpu_ms_per_step": sum(families.values()), "families_ms_per_step": families}


def _memory(run_step: Any, out: Path, variant: str) -> dict[str, Any]:
    """One steady step with the allocator's history on: the step's peak over its start and the
    largest allocations alive at that peak, with where they were made (``memory-<variant>.txt``)."""
    import torch

    torch.cuda.synchronize()
    with allocator_events() as events:
        run_step()
    peak, alive = peak_allocations(events)
    lines = [f"{variant}: peak over the step's start {peak / 2**20:.1f} MiB; {len(alive)} allocations alive at it."]
    sites = [f"{g['bytes'] / 2**20:10.1f} MiB {g['blocks']:5d}x  {g['site']}" for g in by_site(alive)]
    lines += ["", "By site:", *sites, "", "Largest:"]
    lines += [f"{e.get('size', 0) / 2**20:10.1f} MiB  {allocation_site(e)}" for e in alive[:60]]
    name = variant.replace("+", "_plus_").replace("[", "-").replace("]", "")
    (out / f"memory-{name}.txt").write_text("\n".join(lines) + "\n")
    return {
        "step_peak_mib": peak / 2**20,
        "alive_at_peak": len(alive),
        "largest_mib": [round(e.get("size", 0) / 2**20, 1) for e in alive[:10]],
    }


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One variant in this process; returns its record."""
    import torch

    patch, mode = (VARIANTS | EXTRA)[args.child]
    torch.manual_seed(0)
    model, loss_fn, built_by = _build(args, patch)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    run = model
    if mode is not None:
        run = torch.compile(model) if mode == "default" else torch.compile(model, mode=mode)
    ids = torch.randint(0, 128256, (args.batch, args.seq), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()

    def step() -> Any:
        loss = loss_fn(run, ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        return loss

    times, losses, median = timed_steps(step, args.steps, torch.cuda.synchronize)
    record: dict[str, Any] = {
        "variant": args.child,
        "polykernel": patch,
        "compile_mode": mode,
        "model": built_by,
        "tokens_per_s": args.batch * args.seq / median,
        "median_step_s": median,
        "step_times_s": times,
        "first_step_s": times[0],
        "first_3_steps_s": sum(times[:3]),
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        "losses": losses,
    }
    if mode is not None:
        from torch._dynamo.utils import counters

        record["graph_breaks"] = sum(counters["graph_break"].values())
        record["unique_graphs"] = counters["stats"]["unique_graphs"]
    if args.profile_dir:
        record["profile"] = _profile(step, Path(args.profile_dir), args.child)
    if args.memory_dir:
        record["memory"] = _memory(step, Path(args.memory_dir), args.child)
    if patch:
        import polykernel

        record["impls"] = sorted({(d["op"], d["impl"]) for d in polykernel.decisions()})
    return record


def _env() -> dict[str, Any]:
    import torch

    env = {"torch": torch.__version__, "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="directory for compile_llama.json")
    parser.add_argument("--steps", type=int, default=10, help="steps per variant (median of steps 4..N)")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--all-modes", action="store_true", help="also max-autotune-no-cudagraphs and reduce-overhead")
    parser.add_argument("--only", default="", help="comma-separated variant names")
    parser.add_argument("--builtin", action="store_true", help="polykernel.tools.models.llama even when transformers is installed")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per variant")
    parser.add_argument("--profile", action="store_true", help="profile two steady steps per variant (GPU time by kernel family)")
    parser.add_argument("--memory", action="store_true", help="record one steady step's allocations: what is alive at its peak")
    parser.add_argument("--memory-dir", help=argparse.SUPPRESS)
    parser.add_argument("--profile-dir", help=argparse.SUPPRESS)
    args = parse(parser, child)
    if args is None:  # a child process: its record is printed
        return
    names = list(VARIANTS) + (list(EXTRA) if args.all_modes else [])
    if args.only:
        names = [n for n in args.only.split(",") if n in VARIANTS or n in EXTRA]
    args.out.mkdir(parents=True, exist_ok=True)
    passthrough = [
        f"--steps={args.steps}", f"--layers={args.layers}", f"--hidden={args.hidden}", f"--intermediate={args.intermediate}",
        f"--batch={args.batch}", f"--seq={args.seq}", *(["--builtin"] if args.builtin else []),
        *([f"--profile-dir={args.out}"] if args.profile else []),
        *([f"--memory-dir={args.out}"] if args.memory else []),
    ]  # fmt: skip
    sink = RowFile(args.out / "compile_llama.json", {"env": _env(), "args": vars(args) | {"out": str(args.out)}})
    announce(len(names), per_case_s=70, what="variants (each its own process, compile included)", path=str(sink.path))
    for name in names:
        print(f"[{time.strftime('%H:%M:%S')}] {name} ...", flush=True)
        r = run_child(__file__, name, passthrough, args.timeout)
        sink.add(r, f"{name}: " + (f"error: {last_error_line(r)}" if "error" in r else f"{r['tokens_per_s'] / 1e3:.1f}k tokens/s"))
    results = sink.rows
    base = next((r for r in results if r["variant"] == "plain" and "error" not in r), None)
    print(f"\n{'variant':<48} {'tokens/s':>10} {'vs plain':>8} {'peak GiB':>9} {'1st step s':>10}")
    for r in results:
        if "error" in r:
            print(f"{r['variant']:<48} error: {last_error_line(r)}")
            continue
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else ""
        print(f"{r['variant']:<48} {r['tokens_per_s'] / 1e3:>9.1f}k {ratio:>8} {r['peak_memory_gib']:>9.1f} {r['first_step_s']:>10.1f}")
    sink.finish()


if __name__ == "__main__":
    main()
