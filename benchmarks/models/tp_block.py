"""Tensor + sequence parallel Llama on 2 GPUs: tokens/s with and without polykernel's patch.

A transformers Llama (2 layers, hidden 1024, 16/8 heads, bf16) sharded over 2 ranks as
torchtitan does it (tests/_tp_llama.py: sequence-parallel norms, column/row-parallel attention
and MLP), trained for a few steps (forward, backward, AdamW) unpatched, then patched
(``polykernel.integrations.transformers.patch``), same seed, weights and data. Rank 0 writes
``tp_block.json`` to ``--out``: tokens/s (median step time of the timed steps), peak memory,
the losses of both runs and what polykernel ran (``decisions()``); each run's record is written
(``rows``) as it ends, ``complete`` false until both have::

    PYTHONPATH=src python benchmarks/models/tp_block.py --out results/tp        # 2 GPUs, NCCL, ~1 min
    PYTHONPATH=src python benchmarks/models/tp_block.py --out /tmp/tp --smoke   # CPU, gloo, tiny (a check)
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
from typing import Any

import torch
from _common import add_tp_args, tp_defaults, tp_header, tp_model, tp_steps

from polykernel.tools.rows import RowFile, announce

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))

WORLD = 2
FULL = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=8)
SMOKE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def run(model: Any, ids: torch.Tensor, steps: int, warmup: int, device: str) -> dict[str, Any]:
    times, losses = tp_steps(model, ids, steps, warmup, device)
    step = statistics.median(times)
    return {
        "tokens_per_s": ids.numel() / step,
        "median_step_ms": 1e3 * step,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
        "losses": losses,
    }


def worker(rank: int, init_file: str, args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import polykernel
    from _tp_llama import parallelize_llama
    from polykernel.integrations import transformers as pkt

    device = "cpu" if args.smoke else "cuda"
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("gloo" if args.smoke else "nccl", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh(device, (WORLD,))
        base, ids, dtype = tp_model(SMOKE if args.smoke else FULL, 4096, args, device)
        sink = None
        if rank == 0:  # {**header, "complete", "rows", "results", "speedup", "max_loss_diff"}
            path = os.path.join(args.out, "tp_block.json")
            sink = RowFile(path, tp_header(device, WORLD, SMOKE if args.smoke else FULL, dtype, args))
            announce(2, per_case_s=(10 if args.smoke else 3) * (args.steps + args.warmup), what="runs", path=path)
        results: dict[str, Any] = {}
        for name in ("unpatched", "patched"):
            model = parallelize_llama(copy.deepcopy(base), mesh)
            if name == "patched":
                pkt.patch(model)
            polykernel.clear_caches()
            results[name] = run(model, ids, args.steps, args.warmup, device)
            if name == "patched":
                results[name]["decisions"] = [(d["op"], d["impl"], d.get("subclass")) for d in polykernel.decisions()]
            if sink is not None:
                r = results[name]
                sink.add({"run": name, **r}, f"{name}: {r['tokens_per_s']:.0f} tok/s, {r['median_step_ms']:.1f} ms per step")
            del model
        if sink is not None:
            a, b = results["unpatched"], results["patched"]
            speedup = b["tokens_per_s"] / a["tokens_per_s"]
            diff = max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))
            sink.finish(results=results, speedup=speedup, max_loss_diff=diff)
            print(
                f"unpatched {a['tokens_per_s']:.0f} tok/s, patched {b['tokens_per_s']:.0f} tok/s "
                f"({speedup:.2f}x), max |loss diff| {diff:.2e}; ran: {sorted(set(b['decisions']))}"
            )
    finally:
        dist.barrier()
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for tp_block.json")
    add_tp_args(parser)
    args = parser.parse_args(argv)
    tp_defaults(args)
    if not args.smoke and torch.cuda.device_count() < WORLD:
        raise SystemExit(f"tp_block: needs {WORLD} CUDA GPUs, found {torch.cuda.device_count()} (--smoke runs on the CPU)")
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        mp.spawn(worker, args=(os.path.join(d, "init"), args), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main()
