"""Vocab-parallel loss on a column-parallel LM head, 2 GPUs: ours against the gather paths.

A transformers Llama (2 layers, hidden 2048, 32/8 heads, intermediate 8192, V = 128256, bf16)
sharded over the ranks as torchtitan does it (tests/_tp_llama.py: sequence-parallel norms,
column/row-parallel attention and MLP, ``lm_head`` ``ColwiseParallel``), patched
(``polykernel.integrations.transformers.patch``), trained for a few steps (forward, backward,
AdamW), same seed, weights and data, three ways:

- ``vocab_parallel``: the fused linear cross-entropy on each rank's vocabulary slice
  (polykernel.distributed.vocab: one all_gather of [N, 3] statistics per row chunk);
- ``gather_weight``: the fused loss with the LM head's weight gathered to every rank first (the
  DTensor route before vocab-parallel: V·H per step, and each rank computes all V);
- ``gather_logits``: the model's own forward (``lm_head`` gathers its ``[tokens, V]`` logits,
  then polykernel.cross_entropy; what ``patch`` did for a colwise head before).

Rank 0 writes JSON to ``--json``: per path tokens/s (median step of the timed ones), peak memory
per rank (max over the ranks), the losses; and the ratios against ``gather_weight`` and
``gather_logits``. Each path's record is written (``rows``) as it ends, ``complete`` false until
the last::

    torchrun --nproc-per-node 2 benchmarks/models/tp_vocab_loss.py --json results/tp-vocab.json           # 2 GPUs, NCCL
    torchrun --nproc-per-node 2 benchmarks/models/tp_vocab_loss.py --json /tmp/tp-vocab.json --smoke      # CPU, gloo, tiny
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
from typing import Any

import torch
from _common import add_tp_args, tp_defaults, tp_header, tp_model, tp_steps

from polykernel.tools.rows import RowFile, announce

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))

FULL = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8)
SMOKE = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
PATHS = ("vocab_parallel", "gather_weight", "gather_logits")


def use_path(path: str) -> None:
    """Switch the loss path (module attributes; restored by the next call)."""
    from polykernel.distributed import vocab
    from polykernel.integrations.transformers import _loss  # where the fused loss looks _colwise_input up

    vocab.vocab_plan = _ORIGINAL["plan"] if path != "gather_weight" else (lambda *a, **k: None)
    _loss._colwise_input = _ORIGINAL["colwise"] if path != "gather_logits" else (lambda head: None)


_ORIGINAL: dict[str, Any] = {}


def run(model: Any, ids: torch.Tensor, steps: int, warmup: int, device: str) -> dict[str, Any]:
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.empty_cache()
    fused: list[bool] = []  # the last step's: whether the model returned no logits
    times, losses = tp_steps(model, ids, steps, warmup, device, barrier=dist.barrier, seen=lambda out: fused.append(out.logits is None))
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0], device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    step = statistics.median(times)
    return {
        "tokens_per_s": ids.numel() / step,
        "median_step_ms": 1e3 * step,
        "peak_mem_gib_max_rank": float(peak) if device == "cuda" else None,
        "losses": losses,
        "fused_loss": fused[-1] if fused else None,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, help="output JSON path (rank 0 writes it)")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated subset of {PATHS}")
    add_tp_args(parser)
    args = parser.parse_args(argv)
    tp_defaults(args)

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import polykernel
    from _tp_llama import parallelize_llama
    from polykernel.distributed import vocab
    from polykernel.integrations import transformers as pkt
    from polykernel.integrations.transformers import _loss

    _ORIGINAL.update(plan=vocab.vocab_plan, colwise=_loss._colwise_input)
    device = "cpu" if args.smoke else "cuda"
    dist.init_process_group("gloo" if args.smoke else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    try:
        mesh = init_device_mesh(device, (world,))
        base, ids, dtype = tp_model(SMOKE if args.smoke else FULL, 8192, args, device)
        paths = args.paths.split(",")
        sink = None
        if rank == 0:  # {**header, "complete", "rows", "results", "vs_gather_weight", "vs_gather_logits"}
            sink = RowFile(args.json, tp_header(device, world, SMOKE if args.smoke else FULL, dtype, args))
            announce(len(paths), per_case_s=(10 if args.smoke else 5) * (args.steps + args.warmup), what="paths", path=args.json)
        results: dict[str, Any] = {}
        for path in paths:
            use_path(path)
            model = pkt.patch(parallelize_llama(copy.deepcopy(base), mesh))
            polykernel.clear_caches()
            try:
                results[path] = run(model, ids, args.steps, args.warmup, device)
            except torch.OutOfMemoryError as exc:
                results[path] = {"error": f"OutOfMemoryError: {exc}"}
            if sink is not None:
                sink.add({"path": path, **results[path]}, f"{path} { ({k: v for k, v in results[path].items() if k != 'losses'}) }")
            del model
        use_path("vocab_parallel")
        if sink is not None:
            out: dict[str, Any] = {"results": results}
            ours = results.get("vocab_parallel", {})
            for other in ("gather_weight", "gather_logits"):
                theirs = results.get(other, {})
                if "tokens_per_s" in ours and "tokens_per_s" in theirs:
                    out[f"vs_{other}"] = {
                        "tokens_per_s_ratio": ours["tokens_per_s"] / theirs["tokens_per_s"],
                        "peak_mem_ratio": (ours["peak_mem_gib_max_rank"] / theirs["peak_mem_gib_max_rank"]) if device == "cuda" else None,
                        "max_loss_diff": max(abs(x - y) for x, y in zip(ours["losses"], theirs["losses"])),
                    }
            sink.finish(**out)
            print({k: v for k, v in out.items() if k.startswith("vs_")})
    finally:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
