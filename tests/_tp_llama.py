"""A tensor- and sequence-parallel plan for a Hugging Face Llama, as torchtitan shards its Llama.

Shared by tests/test_tp_transformers.py (CPU, gloo), tests/test_tp_gpu2.py (NCCL) and
benchmarks/models/tp_block.py. Per decoder layer:

- the norms: ``SequenceParallel`` (activations ``Shard(1)`` on the sequence, weights replicated);
  the norm receives a DTensor, so polykernel runs it on the local shard;
- attention: its ``hidden_states`` gathered to ``Replicate()``, q/k/v ``ColwiseParallel`` (each
  rank holds half of the heads), o ``RowwiseParallel`` reduce-scattered back to ``Shard(1)``;
- MLP: input gathered, gate/up ``ColwiseParallel``, down ``RowwiseParallel`` to ``Shard(1)``.

q and k reach RoPE as plain tensors holding the rank's heads (as in torchtitan: with DTensor q/k,
transformers' own RoPE and attention would mix DTensors with its plain cos/sin and mask).
``dtensor_mlp=True`` keeps gate/up's outputs as DTensors (``use_local_output=False``): swiglu
then sees ``Shard(2)`` DTensors (polykernel's route) instead of plain local tensors. The embedding output is sharded on the sequence before
the first layer (positions and the causal mask are made from the full sequence); the final norm
is sequence parallel and ``lm_head`` column-parallel with its logits gathered (transformers'
own ``colwise_gather_output``), so the unpatched loss sees plain, replicated logits; patched,
the fused linear cross-entropy runs vocab-parallel on the colwise ``lm_head``'s shards
(polykernel.distributed.vocab) and no logits are made.

Also the spawn/report plumbing of the multi-process tests (tests/test_dtensor*.py, test_tp_*.py):
``spawn_report`` runs a worker on every rank and reads back the JSON report that rank 0 wrote with
``finish_worker``.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from typing import Any


def parallelize_llama(model: Any, mesh: Any, *, dtensor_mlp: bool = False) -> Any:
    """Shard ``model`` (a ``LlamaForCausalLM``) over the 1-D ``mesh`` in place; returns it."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    plan: dict[str, Any] = {
        "model.layers.0": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    for i in range(len(model.model.layers)):
        p = f"model.layers.{i}"
        plan.update(
            {
                f"{p}.input_layernorm": SequenceParallel(),
                f"{p}.self_attn": PrepareModuleInput(
                    input_kwarg_layouts={"hidden_states": Shard(1)}, desired_input_kwarg_layouts={"hidden_states": Replicate()}
                ),
                f"{p}.self_attn.q_proj": ColwiseParallel(),
                f"{p}.self_attn.k_proj": ColwiseParallel(),
                f"{p}.self_attn.v_proj": ColwiseParallel(),
                f"{p}.self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
                f"{p}.post_attention_layernorm": SequenceParallel(),
                f"{p}.mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                f"{p}.mlp.gate_proj": ColwiseParallel(use_local_output=not dtensor_mlp),
                f"{p}.mlp.up_proj": ColwiseParallel(use_local_output=not dtensor_mlp),
                f"{p}.mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
            }
        )
    return parallelize_module(model, mesh, plan)


def full_grads(model: Any) -> dict[str, Any]:
    """Each parameter's gradient as a plain full tensor (DTensor gradients gathered)."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is not None and hasattr(g, "full_tensor"):
            g = g.full_tensor()
        out[name] = g
    return out


def run_job(report: dict[str, Any], name: str, job: Callable[[], Any]) -> None:
    """``report[name] = job()``, or the error and its traceback: one failing case does not hide the others."""
    import traceback

    try:
        report[name] = job()
    except Exception as exc:
        report[name] = {"error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()}


def finish_worker(rank: int, report: Any, out_file: str) -> None:
    """A worker's last step: rank 0 writes ``report`` to ``out_file``; all ranks leave the group."""
    import torch.distributed as dist

    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


def spawn_report(worker: Callable[..., None], nprocs: int) -> Any:
    """Run ``worker(rank, init_file, out_file)`` on ``nprocs`` spawned ranks; the report it wrote."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "report.json")
        mp.spawn(worker, args=(os.path.join(d, "init"), out), nprocs=nprocs, join=True)
        with open(out) as f:
            return json.load(f)
