"""What an op's DTensor layout (``Op(dtensor_layout=...)``) says, checked without a device mesh.

A layout says on which dims of its lead argument an op may be sharded and, for each such dim,
where every other tensor argument must be (``expect``: the same shard dim, another dim, or
replicated): the eager route and the compiled sharding rules then run the op on each rank's local
shards and take the outputs for shards of the global result. That is only right if the op's rows
really are independent along those dims, so for every op with a layout, on its parity cases
(CPU, in float64): the reference run on the shards the layout prescribes (two ranks) gives the shards of
the reference's result (a loss: partial sums that add up to it). A wrong ``expect`` (a target left
replicated, a weight sharded), a reduced dim among ``lead_dims`` or a misplaced output fails here
for any op, with no table of ops to keep (``test_the_shard_check_catches_a_wrong_layout``).

RoPE's and M-RoPE's tables follow q and k on another dim than theirs: spelled out below. With real
DTensors on two processes: ``test_dtensor.py``.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest
import torch

from polykernel.core import registry
from polykernel.distributed.layout import ANY, ROWS, rows_with
from polykernel.ops import OP_MODULES

RANKS = 2
LAID_OUT = [op_id for op_id in OP_MODULES if registry.get_op(op_id).dtensor_layout is not None]


def _outputs(out: Any) -> tuple[Any, ...]:
    return out if isinstance(out, tuple) else (out,)


def _exact(a: Any) -> Any:
    """An argument in float64, where the reference computes exactly enough that the shards' results
    match the whole's whatever code path (vectorized or not) a slice takes."""
    if not isinstance(a, torch.Tensor):
        return a
    return a.detach().double() if a.is_floating_point() else a.detach()


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    if not want.is_floating_point():
        return torch.equal(got, want)
    return torch.allclose(got, want, rtol=1e-9, atol=1e-12, equal_nan=True)


def shard_problems(op: Any, layout: Any, cases: list[Any]) -> tuple[list[str], int]:
    """Where the reference on the shards ``layout`` prescribes is not the shards of its result,
    over ``cases`` and every dim of the lead that ``layout`` lets be sharded; and how many
    (case, dim) pairs were run."""
    signature = inspect.signature(op.reference)
    problems, runs = [], 0
    for case in cases:
        bound = signature.bind(*case.args, **case.kwargs)
        bound.apply_defaults()
        args = [_exact(a) for a in bound.arguments.values()]
        if layout.loss_args is not None:  # as the route does for a mean: each rank's sum, added up
            args[layout.loss_args[2]] = "sum"
        lead = args[0]
        kinds = layout.lead_dims
        dims = range(lead.dim() - 1) if kinds == ROWS else range(lead.dim()) if kinds == ANY else kinds
        with torch.no_grad():
            full = _outputs(op.reference(*args))
        for d in dims:
            if d >= lead.dim() or lead.shape[d] < RANKS:  # nothing to split
                continue
            where = f"{case.label} sharded on dim {d}"
            expect = layout.expect(tuple(args), d)
            if isinstance(expect, str):
                problems.append(f"{where}: lead_dims allows it, expect refuses it ({expect})")
                continue
            try:
                shards = [list(args) for _ in range(RANKS)]
                for i, dim in expect.items():
                    if dim is not None:
                        for rank, piece in enumerate(torch.tensor_split(args[i], RANKS, dim=dim)):
                            shards[rank][i] = piece
                with torch.no_grad():
                    local = [_outputs(op.reference(*s)) for s in shards]
            except Exception as exc:
                problems.append(f"{where}: the reference fails on the shards: {type(exc).__name__}: {exc}")
                continue
            runs += 1
            if len(layout.outputs) != len(full):
                problems.append(f"{where}: outputs {layout.outputs} for the reference's {len(full)} outputs")
                continue
            for o, like in enumerate(layout.outputs):
                if like == "loss":
                    got = sum(out[o] for out in local)
                elif expect.get(like) is None:
                    problems.append(f"{where}: output {o} is placed like argument {like}, which is replicated")
                    continue
                else:
                    got = torch.cat([out[o] for out in local], dim=expect[like])
                if not _same(got, full[o]):
                    problems.append(f"{where}: output {o} on the shards is not the shards of the reference's")
    return problems, runs


def _cases(op: Any) -> list[Any]:
    return op.cases(torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("op_id", LAID_OUT)
def test_the_reference_on_the_shards_a_layout_prescribes_gives_the_shards_of_its_result(op_id):
    op = registry.get_op(op_id)
    problems, runs = shard_problems(op, op.dtensor_layout, _cases(op))
    assert problems == []
    assert runs, f"{op_id}: no parity case has a shardable dim of two rows or more: the check ran nothing"


WRONG = {
    "a sharded weight": ("norm.rms_norm", {"expect": rows_with(1)}),
    "the normalized dim sharded": ("norm.rms_norm", {"lead_dims": ANY}),
    "the channels of a group norm sharded": ("norm.group_norm", {"lead_dims": (0, 1)}),
    "targets left replicated": ("loss.cross_entropy", {"expect": rows_with()}),
    "the LM head sharded with the rows": ("loss.fused_linear_cross_entropy", {"expect": rows_with(1, 2)}),
    "up replicated while gate is sharded": ("activation.swiglu", {"expect": rows_with()}),
    "routing weights left replicated": ("moe.moe_experts", {"expect": rows_with(1)}),
    "the rotated head dim sharded": ("embedding.rope", {"lead_dims": (0, 1, 2, 3)}),
    "an output forgotten": ("norm.fused_add_rms_norm", {"outputs": (0,)}),
}


@pytest.mark.parametrize("mistake", list(WRONG))
def test_the_shard_check_catches_a_wrong_layout(mistake):
    op_id, changes = WRONG[mistake]
    op = registry.get_op(op_id)
    problems, _ = shard_problems(op, dataclasses.replace(op.dtensor_layout, **changes), _cases(op))
    assert problems


def test_rope_tables_follow_q_and_k_on_their_own_dims():
    """cos/sin ``[B, T, D]`` (or ``[1, T, D]``, shared by the batch) beside q, k ``[B, H, T, D]``:
    with the batch sharded, per-batch tables are too (a shared one is replicated); with the heads,
    replicated; with the sequence, sharded on their dim 1. Never the head dim, which the rotation mixes."""
    layout = registry.get_op("embedding.rope").dtensor_layout
    assert layout.why_not == "it is the head dim D, which the rotation mixes"
    q, k = torch.empty(2, 4, 3, 8), torch.empty(2, 2, 3, 8)
    per_batch, shared = torch.empty(2, 3, 8), torch.empty(1, 3, 8)
    assert layout.expect((q, k, per_batch, per_batch), 0) == {0: 0, 1: 0, 2: 0, 3: 0}
    assert layout.expect((q, k, shared, shared), 0) == {0: 0, 1: 0, 2: None, 3: None}
    assert layout.expect((q, k, per_batch, per_batch), 1) == {0: 1, 1: 1, 2: None, 3: None}
    assert layout.expect((q, k, per_batch, per_batch), 2) == {0: 2, 1: 2, 2: 1, 3: 1}


def test_mrope_tables_follow_q_and_k_one_dim_further():
    """M-RoPE's tables ``[3, B, T, D]`` (one per position axis) put the batch and the sequence one
    dim further than RoPE's; the same rules otherwise."""
    layout = registry.get_op("embedding.mrope").dtensor_layout
    assert layout.why_not == "it is the head dim D, which the rotation mixes"
    q, k = torch.empty(2, 4, 3, 8), torch.empty(2, 2, 3, 8)
    per_batch, shared = torch.empty(3, 2, 3, 8), torch.empty(3, 1, 3, 8)
    assert layout.expect((q, k, per_batch, per_batch), 0) == {0: 0, 1: 0, 2: 1, 3: 1}
    assert layout.expect((q, k, shared, shared), 0) == {0: 0, 1: 0, 2: None, 3: None}
    assert layout.expect((q, k, per_batch, per_batch), 1) == {0: 1, 1: 1, 2: None, 3: None}
    assert layout.expect((q, k, per_batch, per_batch), 2) == {0: 2, 1: 2, 2: 2, 3: 2}
