"""Training step of a small MoE model: plain vs patched vs Liger vs torch.compile (issues 24, 33).

``--model qwen3_moe`` (default): ``transformers`` Qwen3-MoE at Qwen3-30B-A3B's widths (hidden
2048, 32/4 heads of 128, 128 experts of width 768, top-8, norm_topk_prob, vocab 151936), default
4 layers. ``--model mixtral``: Mixtral-8x7B's widths (hidden 4096, 32/8 heads, 8 experts of width
14336, top-2, vocab 32000), default 2 layers. bf16, fused AdamW, batch ``--batch`` x ``--seq``
(default 4 x 2048). Variants, each in its own subprocess (fresh allocator and compile caches):

- ``plain``: transformers as it comes (its experts: the ``grouped_mm`` implementation, 5.x's
  default where it dispatches); ``plain[eager]``: its Python loop over experts;
- ``polykernel``: ``patch(model)`` (norms, rope, the fused loss, the experts through
  ``moe_experts``); ``polykernel[no-experts]``: the same with ``moe_experts=False``;
- ``liger``: Liger-Kernel's patch of the model (``_apply_liger_kernel_to_instance``), where it
  has one and is installed. Liger >= 0.8.5 runs transformers 5's experts through its fused MoE
  kernels, autotuned on first use (~170 Triton configs: minutes in the first step, which a
  short ``--timeout`` cuts); ``liger[fixed]``: the same with that autotuning off
  (``LIGER_FUSED_MOE_AUTOTUNE=0``, Liger's one default config per kernel);
- ``compile``, ``polykernel+compile``: ``torch.compile(model)`` of the two.

Per variant: tokens/s from the median step time of steps 4..N, peak memory, the first step's
time (compile), the losses, and (patched) the impls that ran.

    PYTHONPATH=src python benchmarks/models/moe_train.py --json moe_train.json               # H200, ~5 min
    PYTHONPATH=src python benchmarks/models/moe_train.py --json /tmp/t.json --tiny --device cpu  # smoke test
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from _child import parse, run_all
from _common import timed_steps

from polykernel.tools.rows import RowFile

# name -> (patch switches or None, experts_implementation or None, compile)
VARIANTS: dict[str, tuple[dict[str, bool] | None, str | None, bool]] = {
    "plain": (None, None, False),
    "plain[eager]": (None, "eager", False),
    "polykernel": ({}, None, False),
    "polykernel[no-experts]": ({"moe_experts": False}, None, False),
    "liger": (None, "liger", False),
    "liger[fixed]": (None, "liger-fixed", False),
    "compile": (None, None, True),
    "polykernel+compile": ({}, None, True),
}


def _config(args: argparse.Namespace, experts_implementation: str | None) -> Any:
    import transformers

    extra = {} if experts_implementation in (None, "liger", "liger-fixed") else {"experts_implementation": experts_implementation}
    if args.model == "mixtral":
        if args.tiny:
            sizes = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_local_experts=4, num_experts_per_tok=2)
            heads = dict(num_attention_heads=4, num_key_value_heads=2)
        else:
            sizes = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2)
            heads = dict(num_attention_heads=32, num_key_value_heads=8)
        layers = args.layers or 2
        return transformers.MixtralConfig(**sizes, **heads, num_hidden_layers=layers, max_position_embeddings=max(args.seq, 2048), **extra)
    if args.tiny:
        sizes = dict(vocab_size=512, hidden_size=64, moe_intermediate_size=32, intermediate_size=128, num_experts=8, num_experts_per_tok=2)
        heads = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    else:
        sizes = dict(
            vocab_size=151936, hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144, num_experts=128, num_experts_per_tok=8
        )
        heads = dict(num_attention_heads=32, num_key_value_heads=4, head_dim=128)
    return transformers.Qwen3MoeConfig(
        **sizes,
        **heads,
        num_hidden_layers=args.layers or 4,
        norm_topk_prob=True,
        max_position_embeddings=max(args.seq, 2048),
        tie_word_embeddings=False,
        **extra,
    )


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One variant in this process; returns its record."""
    import torch
    import transformers

    switches, experts_impl, use_compile = VARIANTS[args.child]
    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    config = _config(args, experts_impl)
    with torch.device(device):  # initialised on the device (Mixtral's 2 layers: ~6B parameters)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    if experts_impl in ("liger", "liger-fixed"):
        if experts_impl == "liger-fixed":  # read by liger_kernel.ops.fused_moe_kernels at import
            os.environ["LIGER_FUSED_MOE_AUTOTUNE"] = "0"
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN, _apply_liger_kernel_to_instance

        if config.model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
            raise RuntimeError(f"Liger-Kernel has no patch for {config.model_type}")
        _apply_liger_kernel_to_instance(model=model)
    if switches is not None:
        from polykernel.integrations.transformers import patch, patched

        patch(model, **switches)
        kinds = {k: (v if isinstance(v, str) else len(v)) for k, v in patched(model).items()}
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device == "cuda")
    run = torch.compile(model) if use_compile else model
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()

    def step() -> Any:
        loss = run(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    times, losses, median = timed_steps(step, args.steps, sync)
    record: dict[str, Any] = {
        "variant": args.child,
        "experts_implementation": model.config._experts_implementation,
        "tokens_per_s": args.batch * args.seq / median,
        "median_step_s": median,
        "step_times_s": times,
        "first_step_s": times[0],
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
        "losses": losses,
    }
    if use_compile:
        from torch._dynamo.utils import counters

        record["graph_breaks"] = sum(counters["graph_break"].values())
    if switches is not None:
        import polykernel

        record["patched"] = kinds
        record["impls"] = sorted({(d["op"], d["impl"]) for d in polykernel.decisions()})
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write the records and the environment here")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny config (a CPU smoke test)")
    parser.add_argument("--model", default="qwen3_moe", choices=("qwen3_moe", "mixtral"))
    parser.add_argument("--layers", type=int, default=0, help="decoder layers (default: 4 for qwen3_moe, 2 for mixtral)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10, help="steps per variant (median of steps 4..N)")
    parser.add_argument("--only", default="", help="comma-separated variant names")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per variant")
    args = parse(parser, child, required=None)
    if args is None:
        return
    names = [n for n in VARIANTS if not args.only or n in args.only.split(",")]
    argv = [
        f"--device={args.device}",
        f"--model={args.model}",
        f"--layers={args.layers}",
        f"--batch={args.batch}",
        f"--seq={args.seq}",
        f"--steps={args.steps}",
    ]
    argv += ["--tiny"] if args.tiny else []

    def summary(rec: dict[str, Any]) -> str:
        peak = "" if rec["peak_memory_gib"] is None else f"  peak {rec['peak_memory_gib']:.1f} GiB"
        return f"{rec['tokens_per_s']:10.0f} tokens/s  step {rec['median_step_s'] * 1e3:8.1f} ms{peak}  first {rec['first_step_s']:.1f} s"

    import torch

    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    out = RowFile(args.json, {"env": env, "args": vars(args) | {"json": str(args.json)}})  # records kept as each variant ends
    records = run_all(
        __file__, names, argv, args.timeout, summary, width=24, failed="failed", out=out, per_variant_s=15 if args.tiny else 40
    )
    plain = next((r for r in records if r.get("variant") == "plain" and "error" not in r), None)
    if plain is not None:
        for r in records:
            if "error" not in r:
                r["speedup_vs_plain"] = r["tokens_per_s"] / plain["tokens_per_s"]
    out.finish()  # (the rows are the records: the speedups are written now)


if __name__ == "__main__":
    main()
