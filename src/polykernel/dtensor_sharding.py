"""Sharding rules for the ``torch.ops.polykernel.*`` custom ops, so DTensors compile.

Under ``torch.compile`` an op call is its custom op (:mod:`polykernel.library`), not the eager
route of :mod:`polykernel.dtensor`. DTensor needs a sharding strategy for each custom op it meets
or the trace fails ("does not have a sharding strategy registered"). This module registers one
per op with ``torch.distributed.tensor.experimental.register_sharding`` (torch >= 2.5; the same
API in 2.11 and 2.13), built from the eager route's layouts (``dtensor.LAYOUTS``): for each dim
the lead argument may be sharded on, the placement of every tensor argument and output, plus
all-``Replicate()``. DTensor then runs the custom op's real impl (the dispatcher's choice) on the
local shards and redistributes anything else, as the eager route does.

Covered: the forward custom op (``polykernel::<op>``: inference, or ``torch.no_grad``). Not
expressible here, so left to DTensor's default (an error naming the op):

- the training ops (``<op>_train``, ``<op>_train_backward``), so compiled training on DTensors
  decomposes the op (``library.CompiledOp.call``). ``register_sharding`` gives one placement per
  schema return (its strategy has ``len(schema.returns)`` output specs), but both ops return a
  ``Tensor[]`` whose length is known only per call: ``_train``'s saved list needs a tuple of
  specs where the API makes one (DTensor's ``wrap`` then asserts "Expected list/tuple"), and
  ``_train_backward``'s gradient list needs a spec per gradient, ``Shard`` for the rows'
  and ``Partial()`` for a replicated weight's, where the API makes one ("output_specs has 1
  output which does not equal the number of op outputs: 2"). Checked with torch 2.13; DTensor's
  lower-level strategy registration can express both, but it is private API;
- a ``reduction="mean"`` loss over sharded rows: the mean divides by the global count of
  scored rows, which no placement says; such a loss is computed replicated (``"sum"`` gives
  ``Partial()``, ``"none"`` shards like the targets).

Registered when the library builds a custom op while ``torch.distributed.tensor`` is loaded
(Dynamo loads it), and for the ops already built on the first call of :func:`register_built`.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .op import Op

__all__ = ["register", "register_built"]

_lock = threading.Lock()
# The ops with a layout in polykernel.dtensor.LAYOUTS (kept equal by tests/test_dtensor_compile.py).
_LAID_OUT = frozenset(
    {
        "norm.rms_norm",
        "norm.fused_add_rms_norm",
        "norm.layer_norm",
        "activation.softmax",
        "activation.swiglu",
        "activation.geglu",
        "embedding.rope",
        "loss.cross_entropy",
        "loss.fused_linear_cross_entropy",
    }
)
_done: set[str] = set()


def _rules(op: Op) -> Any:
    """The sharding function for ``op``'s forward custom op (register_sharding's contract:
    the op's arguments, DTensor specs for tensors; returns ``[(outputs, inputs), ...]``).
    :mod:`polykernel.dtensor` is imported when the rules are first asked for, i.e. when a DTensor
    meets the op: importing it routes the eager path's subclass checks (see its docstring), which
    a process that only compiles plain tensors must not pay for."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    def is_spec(a: Any) -> bool:
        return hasattr(a, "placements") and hasattr(a, "shape")

    def sharding(*args: Any, **_: Any) -> list[tuple[list[Any], list[Any]]]:
        from . import dtensor

        layout = dtensor.LAYOUTS[op.id]
        loss = dtensor._LOSS_ARGS.get(op.id)
        lead = args[0]
        ndim = len(lead.shape)
        tensors = [i for i, a in enumerate(args) if is_spec(a)]
        n_out = len(layout.outputs)
        out = [([Replicate()] * n_out, [Replicate() if i in tensors else None for i in range(len(args))])]
        kinds = layout.lead_dims
        dims = range(ndim - 1) if kinds == dtensor._ROWS else range(ndim) if kinds == dtensor._ANY else kinds
        for d in dims:
            expect = layout.expect(tuple(args), d)
            if not isinstance(expect, dict):
                continue
            inputs = [None if i not in tensors else Replicate() if expect.get(i) is None else Shard(expect[i]) for i in range(len(args))]
            if loss is not None:
                reduction = args[loss[2]] if len(args) > loss[2] else "mean"
                if reduction == "mean":
                    continue  # the global count of scored rows: replicated only
                outs = [Partial() if reduction == "sum" else inputs[loss[0]]]
            else:
                outs = [inputs[like] for like in layout.outputs]
            out.append((outs, inputs))
        return out

    return sharding


def register(op: Op, compiled: Any) -> None:
    """Register ``op``'s sharding rules on its forward custom op (``compiled``: the library's
    ``CompiledOp``); once per op, and only for ops with a row layout."""
    if op.id not in _LAID_OUT:
        return
    with _lock:
        if op.id in _done:
            return
        try:
            from torch.distributed.tensor.experimental import register_sharding
        except ImportError:  # a torch without it (< 2.5): DTensor's default, an error naming the op
            return
        register_sharding(compiled.forward)(_rules(op))
        _done.add(op.id)


def register_built() -> None:
    """Register the rules of every custom op the library has built so far."""
    from . import library, registry

    for op_id, compiled in list(library._built.items()):
        register(registry.get_op(op_id), compiled)
