"""An op's own facts for ``torch.compile``: ``Op(compile_mode=..., saved=..., saved_grads=...)``,
their values and types (read by :mod:`polykernel.compile.library`).

Torch-free and free of side effects, so that an op file can import it without loading the
custom-op machinery (that loads on the first compiled call).

``saved`` is a tuple of kinds, one per tensor the training custom op saves: a fixed set per op
(the schema returns a fixed tuple, which DTensor's ``register_sharding`` needs: one placement per
return). The torch impl's split defines them and every impl's split follows it. Per tensor:

- ``"rows"``: one value per row of the lead (first) argument: the split's ``[M]``, returned by the
  custom op shaped ``lead.shape[:-1]``, so that rows sharded on dim d shard it on dim d too (a
  flattened ``[M]`` would interleave ranks' rows on dim 0, and split unevenly otherwise);
- ``"lead"``: shaped like the lead argument (a gradient of it), or an empty placeholder shaped like
  the lead with its last dim 0 (so that it shards wherever the lead's rows do: DTensor refuses
  ``Shard(d)`` of a dim smaller than the mesh): placed like the lead;
- ``"sum"``: a sum over the rows (the non-ignored count, a weight's gradient), or an empty
  placeholder of a fixed rank: ``Partial`` over sharded rows;
- anything else (``"any"``): no sharding rule, so the op decomposes in compiled training on DTensors.

Every slot keeps one meaning whatever ``grad_mask`` and ``reduction`` ask for: a slot a call does
not compute holds an empty placeholder (no allocation), which the backward ignores. A split that
saves fewer gets empty 1-d tensors appended. An op with ``saved=None`` saves nothing (its splits
are not used), and its compiled backward recomputes the forward.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Any

__all__ = ["MODES", "PLACED_KINDS", "SavedGrads"]

# What a compiled graph runs for an op called without ``impl=`` (``Op(compile_mode=...)``, which
# POLYKERNEL_COMPILE_<OP>=ours|decompose overrides): "ours", its custom ops (the dispatcher's
# impl runs), or "decompose", Dynamo traces the op's torch reference and Inductor fuses it with
# its neighbours. Chosen per op from measurements (the reason is beside it in the op's file).
# "eager": a graph break around the eager dispatcher, for ops whose outputs no custom-op schema
# can hold (the fused preference/RL losses' NamedTuples, data-dependent statistic shapes); an
# op's own fact, which POLYKERNEL_COMPILE_<OP> neither sets nor overrides.
MODES = ("ours", "decompose", "eager")

# The saved-tensor kinds that have a DTensor placement (polykernel.compile.sharding).
PLACED_KINDS = ("rows", "lead", "sum")


class SavedGrads(typing.NamedTuple):
    """Calls whose saved tensors are the gradients themselves, computed for ``grad_output = 1``.

    An op whose training forward saves, for some calls, the finished gradients for a unit scalar
    grad_output (the fused linear cross-entropy with reduction "mean"/"sum": its walk computes them
    with the loss) says so with ``Op(saved_grads=SavedGrads(...))``. Its compiled backward is then
    ``saved * grad_output``, traced into the graph by the autograd formula instead of run inside
    the opaque backward custom op (see :mod:`polykernel.compile.library`)."""

    slots: dict[str, int]  # argument name -> the saved slot holding its gradient
    when: Callable[[dict[str, Any]], bool]  # on the call's arguments by name: whether it applies
