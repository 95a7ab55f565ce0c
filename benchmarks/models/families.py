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
    # where a family's step spends its GPU time: one more step under the torch profiler, its 25
    # kernels of most time printed and kept in the record (``kernels``)
    python benchmarks/models/families.py --families gpt_oss --variants polykernel,compile --profile 25 --json /tmp/gpt_oss.json
    # a quick check of the script on the CPU (tiny shapes, plain and polykernel)
    python benchmarks/models/families.py --tiny --variants plain,polykernel --steps 1 --warmup 1 --json /tmp/families.json

Liger is skipped (recorded as an error) where it has no patch for a family; ``torch.compile``
compiles the whole model (``fullgraph=False``: the families' forwards have data-dependent parts).
The summary gives, per family, each variant's speed-up over plain and its first loss minus plain's.
The two vision-language families are ``vision_families.py``'s (the same machinery, ``_common``'s
family runs); tests/tools/test_families_scripts.py checks that the two scripts cover
``SUPPORTED_MODEL_TYPES``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _child  # this folder's helpers: one variant per process, the family runs
import _common

from polykernel.tools.rows import RowFile, announce

VARIANTS = _common.FAMILY_VARIANTS

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
    "qwen2": ({"vocab_size": 151936}, {}),
    "qwen3": ({"vocab_size": 151936}, {}),
    "gemma": ({"vocab_size": 256000, "head_dim": 256}, {}),  # Gemma's widths, as gemma2's below
    "gemma2": ({"vocab_size": 256000, "head_dim": 256, "query_pre_attn_scalar": 256}, {"query_pre_attn_scalar": 16, "sliding_window": 8}),
    "olmo2": ({"vocab_size": 100352}, {}),
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
            "num_key_value_heads": 16,  # MLA: every head has its own keys (with BASE's 8, SDPA saw 16 query and 32 key heads)
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
            "num_key_value_heads": 4,
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


def build(family: str, tiny: bool, seq: int, batch: int, device: Any, dtype: Any) -> tuple[Any, dict[str, Any]]:
    """The randomly initialised causal LM of ``family`` and a seeded batch of token ids (its own labels)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = config_for(family, tiny)
    with torch.device(device):  # initialised on the device: a CPU init of ~2B parameters takes longer than the run
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=gen).to(device)
    return model, {"input_ids": ids, "labels": ids}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _common.add_family_args(
        parser, list(FAMILIES), batch="sequences per step (default 4; tiny: 2)", seq="tokens per sequence (default 2048; tiny: 32)"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.batch = args.batch or (2 if args.tiny else 4)
    args.seq = args.seq or (32 if args.tiny else 2048)
    if args.child:
        _child.emit(_common.family_child(args, lambda family, device, dtype: build(family, args.tiny, args.seq, args.batch, device, dtype)))
        return
    families, variants = _common.family_selection(parser, args, FAMILIES)
    argv, setup = _common.family_argv(args)
    out = RowFile(args.json, {"setup": setup})  # each run's record kept as it ends (a cut run keeps them)
    # a run on an H100: 12-18 s, torch.compile's 40-71 s (benchmarks/results/h100-2026-12-06-nineteenth/)
    announce(len(families) * len(variants), per_case_s=10 if args.tiny else 30, what="runs", path=args.json)
    summary = _common.run_families(__file__, families, variants, argv, args.timeout, out)
    out.finish(summary=summary)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
