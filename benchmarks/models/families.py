"""Training throughput and peak memory of every text family ``integrations.transformers.patch``
supports, at ~1B shapes (issue 23's table): plain PyTorch, polykernel, Liger-Kernel and
``torch.compile``, each variant of each family in a fresh process of its own (its own allocator,
compile caches and Liger's process-wide patches).

A step is a forward with labels (the model's causal-LM loss), the backward and an AdamW step on a
randomly initialised model built from a config (nothing is downloaded), bf16 weights on CUDA. The
record of a run: median step time of the timed steps, tokens/s, peak CUDA memory (allocated), the
first step's loss (the variants start from the same weights and batch: their losses agree), and
what polykernel ran (``decisions()``).

    # the H200 table (one run; ~1B shapes, 8 timed steps after 3 warm-up steps)
    python benchmarks/models/families.py --json benchmarks/results/h200-families.json
    # a quick check of the script on the CPU (tiny shapes, plain and polykernel)
    python benchmarks/models/families.py --tiny --variants plain,polykernel --steps 1 --warmup 1 --json /tmp/families.json

Liger is skipped (recorded as an error) where it has no patch for a family; ``torch.compile``
compiles the whole model (``fullgraph=False``: the families' forwards have data-dependent parts).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _child  # this folder's helper: one variant per process

from polykernel.tools.rows import RowFile, announce

VARIANTS = ("plain", "polykernel", "liger", "compile")

# ~1B dense: 16 layers of width 2048, 16 heads of 128 (8 KV heads), MLP 8192; MoE families keep
# the attention and spread the MLP over experts. Vocabularies are each family's own (the loss over
# them is a large part of a step).
BASE = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=8192,
    vocab_size=128256,
)
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    vocab_size=256,
    pad_token_id=0,  # the families' own special ids lie past a tiny vocabulary
    bos_token_id=1,
    eos_token_id=2,
)
# family -> (overrides at ~1B, overrides at the tiny size)
FAMILIES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "llama": ({}, {}),
    "mistral": ({"vocab_size": 32768}, {}),
    "qwen3": ({"vocab_size": 151936}, {}),
    "gemma2": ({"vocab_size": 256000, "head_dim": 256, "query_pre_attn_scalar": 256}, {"query_pre_attn_scalar": 16, "sliding_window": 8}),
    "gemma3_text": (
        {"vocab_size": 262144, "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 512},
        {"query_pre_attn_scalar": 16, "sliding_window": 8},
    ),
    "qwen3_moe": (
        {"vocab_size": 151936, "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 1024},
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    ),
    "mixtral": (
        {"vocab_size": 32000, "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 2048},
        {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32},
    ),
    "gpt_oss": (
        {
            "vocab_size": 201088,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "intermediate_size": 2048,
            "head_dim": 64,
            "num_attention_heads": 32,
            "sliding_window": 128,
        },
        {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32, "sliding_window": 8},
    ),
    "phi3": ({"vocab_size": 32064, "partial_rotary_factor": 0.75}, {"partial_rotary_factor": 0.5, "eos_token_id": 1}),
    "granite": (
        {
            "vocab_size": 49155,
            "embedding_multiplier": 12.0,
            "residual_multiplier": 0.22,
            "attention_multiplier": 0.0078125,
            "logits_scaling": 8.0,
        },
        {"embedding_multiplier": 2.0, "residual_multiplier": 0.5, "attention_multiplier": 0.1, "logits_scaling": 4.0},
    ),
    "glm4": ({"vocab_size": 151552}, {}),  # partial_rotary_factor 0.5, interleaved: rope's options
    "smollm3": ({"vocab_size": 128256}, {"no_rope_layers": [1, 0], "bos_token_id": 1, "eos_token_id": 2}),
    "olmo3": ({"vocab_size": 100278, "sliding_window": 4096}, {"sliding_window": 8, "eos_token_id": 1}),
    "ministral": ({"vocab_size": 131072}, {}),
    "exaone4": ({"vocab_size": 102400, "sliding_window": 4096}, {"sliding_window": 8}),
    "deepseek_v3": (
        {
            "vocab_size": 129280,
            "n_routed_experts": 16,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 1024,
            "n_shared_experts": 1,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "q_lora_rank": 768,
            "kv_lora_rank": 256,
            "qk_rope_head_dim": 64,
            "head_dim": 64,  # the rotary part's width (the config's head_dim is what its rotary embedding uses)
            "qk_nope_head_dim": 128,
            "v_head_dim": 128,
        },
        {
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "n_shared_experts": 1,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "q_lora_rank": 32,
            "kv_lora_rank": 32,
            "qk_rope_head_dim": 8,
            "head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 16,
        },
    ),
    "llama4_text": (
        {
            "vocab_size": 202048,
            "num_local_experts": 8,
            "num_experts_per_tok": 1,
            "intermediate_size": 2048,
            "intermediate_size_mlp": 8192,
            "interleave_moe_layer_step": 2,
        },
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "intermediate_size": 32,
            "intermediate_size_mlp": 128,
            "interleave_moe_layer_step": 2,
        },
    ),
}


def config_for(family: str, tiny: bool) -> Any:
    from transformers import AutoConfig

    big, small = FAMILIES[family]
    kwargs = {**(TINY if tiny else BASE), **(small if tiny else big)}
    return AutoConfig.for_model(family, **kwargs)


def _build(family: str, variant: str, tiny: bool, device: Any, dtype: Any) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)  # (CUDA's generator too: every variant starts from the same weights)
    with torch.device(device):  # initialised on the device: a CPU init of ~2B parameters takes longer than the run
        model = AutoModelForCausalLM.from_config(config_for(family, tiny), dtype=dtype)
    model.train()
    if variant == "polykernel":
        from polykernel.integrations.transformers import patch

        patch(model)
    elif variant == "liger":
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN, _apply_liger_kernel_to_instance

        if family not in MODEL_TYPE_TO_APPLY_LIGER_FN:
            raise RuntimeError(f"Liger-Kernel has no patch for {family}")
        _apply_liger_kernel_to_instance(model=model)
    elif variant == "compile":
        model = torch.compile(model)
    return model


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One (family, variant) run in this process."""
    import torch

    family, variant = args.child.split(":")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    record: dict[str, Any] = {"family": family, "variant": variant, "device": str(device), "dtype": str(dtype).removeprefix("torch.")}
    try:
        model = _build(family, variant, args.tiny, device, dtype)
        params = list(model.parameters())
        record["parameters"] = sum(p.numel() for p in params)
        opt = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")
        gen = torch.Generator().manual_seed(1)
        vocab = config_for(family, args.tiny).vocab_size
        ids = torch.randint(0, vocab, (args.batch, args.seq), generator=gen).to(device)

        def step() -> float:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        def sync() -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        times = []
        first = None
        for i in range(args.warmup + args.steps):
            if i == args.warmup and device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            sync()
            t0 = time.perf_counter()
            loss = step()
            sync()
            if first is None:
                first = float(loss)
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
        median = statistics.median(times)
        record.update(
            first_loss=first,
            step_seconds=times,
            median_step_seconds=median,
            tokens_per_second=args.batch * args.seq / median,
            peak_memory_bytes=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        )
        if variant == "polykernel":
            import polykernel
            from polykernel.integrations.transformers import patched

            record["patched"] = {k: (v if isinstance(v, str) else len(v)) for k, v in patched(model).items()}
            record["ops"] = sorted({(d["op"], d["impl"]) for d in polykernel.decisions()})
    except Exception as exc:  # one family failing must not lose the others' rows
        import traceback

        record["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the records and the summary here")
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated model types (default: all)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (default 4; tiny: 2)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 2048; tiny: 32)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compiles, autotunes)")
    parser.add_argument("--tiny", action="store_true", help="tiny configs (a CPU check of the script)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when there is one)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.batch = args.batch or (2 if args.tiny else 4)
    args.seq = args.seq or (32 if args.tiny else 2048)
    if args.child:
        _child.emit(child(args))
        return
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [f for f in families if f not in FAMILIES] + [v for v in variants if v not in VARIANTS]
    if bad:
        parser.error(f"unknown families or variants: {', '.join(bad)}")
    argv = [f"--batch={args.batch}", f"--seq={args.seq}", f"--steps={args.steps}", f"--warmup={args.warmup}"]
    argv += ["--tiny"] if args.tiny else []
    argv += [f"--device={args.device}"] if args.device else []
    setup = {k: getattr(args, k) for k in ("batch", "seq", "steps", "warmup", "tiny", "device")}
    out = RowFile(args.json, {"setup": setup})  # each run's record kept as it ends (a cut run keeps them)
    announce(len(families) * len(variants), per_case_s=10 if args.tiny else 120, what="runs", path=args.json)
    for family in families:
        for variant in variants:
            rec = _child.run_child(__file__, f"{family}:{variant}", argv, args.timeout)
            rec.setdefault("family", family), rec.setdefault("variant", variant)
            if "error" in rec:
                line = f"{family:12s} {variant:10s} error: {_child.last_error_line(rec)}"
            else:
                mem = rec["peak_memory_bytes"]
                mem_text = f"{mem / 2**30:6.2f} GiB" if mem is not None else "      -"
                line = f"{family:12s} {variant:10s} {rec['tokens_per_second']:10.0f} tok/s {mem_text}  loss {rec['first_loss']:.4f}"
            out.add(rec, line)
    summary = summarize(out.rows)
    for row in summary:
        print(json.dumps(row), flush=True)
    out.finish(summary=summary)


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per family: each variant's speed-up over plain, and polykernel's peak memory over Liger's."""
    out = []
    by_family: dict[str, dict[str, dict[str, Any]]] = {}
    for r in records:
        by_family.setdefault(r["family"], {})[r["variant"]] = r
    for family, runs in by_family.items():
        ok = {v: r for v, r in runs.items() if "error" not in r}
        row: dict[str, Any] = {"family": family}
        plain = ok.get("plain")
        for v, r in ok.items():
            row[f"{v}_tokens_per_second"] = r["tokens_per_second"]
            if plain is not None:
                row[f"{v}_speedup"] = r["tokens_per_second"] / plain["tokens_per_second"]
        pk, lg = ok.get("polykernel"), ok.get("liger")
        if pk and lg and pk.get("peak_memory_bytes") and lg.get("peak_memory_bytes"):
            row["polykernel_memory_over_liger"] = pk["peak_memory_bytes"] / lg["peak_memory_bytes"]
        row["errors"] = {v: _child.last_error_line(r) for v, r in runs.items() if "error" in r}
        out.append(row)
    return out


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
