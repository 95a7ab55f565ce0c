"""Sharding rules for the ``torch.ops.polykernel.*`` custom ops, so DTensors compile.

Under ``torch.compile`` an op call is its custom op (:mod:`polykernel.compile.library`), not the eager
route of :mod:`polykernel.distributed.dtensor`. DTensor needs a sharding strategy for each custom op it meets
or the trace fails ("does not have a sharding strategy registered"). This module registers one
per op with ``torch.distributed.tensor.experimental.register_sharding`` (torch >= 2.5; the same
API in 2.11 and 2.13), built from the op's layout (``Op.dtensor_layout``, which the eager route
reads too): for each dim
the lead argument may be sharded on, the placement of every tensor argument and output, plus
all-``Replicate()``. DTensor then runs the custom op's real impl (the dispatcher's choice) on the
local shards and redistributes anything else, as the eager route does.

Covered:

- the forward custom op (``polykernel::<op>``: inference, or ``torch.no_grad``);
- the training ops (``<op>_train``, ``<op>_train_backward``; their fixed-arity schemas are in
  :mod:`polykernel.compile.library`): the forward's placements, plus the saved tensors' (one value per
  row: sharded like the rows; shaped like the lead, e.g. the fused linear cross-entropy's
  grad_hidden: placed like it; a sum over the rows, e.g. its grad_weight and grad_bias:
  ``Partial()``), and in the backward each gradient placed like its argument, ``Partial()`` for
  a replicated argument of sharded rows (a norm's weight, cos/sin for head-sharded RoPE, the
  LM head's weight and bias): DTensor reduces it when it is read.

A ``reduction="mean"`` loss over sharded rows (cross_entropy, fused_linear_cross_entropy) has no
rule of its own: the mean divides by the global count of scored rows, which no placement says
(the split scales by its local count; the fused linear cross-entropy even scales its saved
gradients by it in the forward). ``library.CompiledOp.call`` traces it as the same call with
``reduction="sum"`` (our custom ops, whose rules give a ``Partial()`` loss: the training pair, or
the forward op without grad) over the global count (:func:`mean_of_sum`), so compiled training
and inference run our kernels on the local shards, nothing gathered.

Not covered, so DTensor redistributes the arguments to meet the rules (an op whose training
ops have no rules decomposes into its torch reference in compiled training instead:
``library.CompiledOp.call``, logged once; :func:`why_not` says why):

- a vocab-sharded fused linear cross-entropy (the LM head's weight ``Shard(0)``, column
  parallel): each rank holds a slice of every row's logits, and the loss and its gradient need
  the row's logsumexp over all ranks (a max and a sum all-reduced per row chunk, then the
  target's logit from the rank that owns it), i.e. collectives between the kernel's steps. A
  sharding rule only places an op's inputs and outputs, so no rule can say it; DTensor
  redistributes the weight to ``Replicate()`` (an all-gather) to meet the rules above, and the
  eager route does the same.

DTensor caches a strategy per op and argument specs, and by default hashes no non-tensor
argument before the first ``int`` one; each op's cache key is widened here to every argument
(a ``grad_mask`` changes the gradients' shapes; ``casting``, ``reduction`` the outputs).

Registered when the library builds a custom op while ``torch.distributed.tensor`` is loaded
(Dynamo loads it), when a compiled call first meets a DTensor, and for the ops already built on
the first call of :func:`register_built`.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING, Any

from .. import _compat
from ..distributed.layout import ANY, ROWS, Layout, scored
from .facts import PLACED_KINDS

if TYPE_CHECKING:
    from ..core.op import Op

__all__ = ["mean_of_sum", "register", "register_built", "sharded_mean", "why_not"]

_lock = threading.Lock()
# The layouts of the ops whose rules were registered (``Op.dtensor_layout``), recorded by
# register() for the functions that run while Dynamo traces (a dict read there).
_layouts: dict[str, Layout] = {}
_done: set[str] = set()
_trained: set[str] = set()  # ops whose training ops got rules
_NO_RULES = "no sharding rules in this torch (DTensor's strategy cache cannot be made to key on every argument)"
_rules_off = False  # set by register() when that is so (read at trace time, by why_not)


def _is_spec(a: Any) -> bool:
    return hasattr(a, "placements") and hasattr(a, "shape")


def _strategies(op_id: str, args: tuple[Any, ...]) -> list[tuple[int | None, list[Any], list[Any]]]:
    """``(d, outputs, inputs)`` per acceptable sharding of the forward op on ``args`` (its
    arguments; specs for tensors): ``d`` the lead's shard dim, None for all-``Replicate()``.
    Runs once a DTensor met the op (after :func:`register`, which recorded the op's layout)."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    layout = _layouts[op_id]
    loss = layout.loss_args
    ndim = len(args[0].shape)
    tensors = [i for i, a in enumerate(args) if _is_spec(a)]
    n_out = len(layout.outputs)
    out: list[tuple[int | None, list[Any], list[Any]]] = [
        (None, [Replicate()] * n_out, [Replicate() if i in tensors else None for i in range(len(args))])
    ]
    kinds = layout.lead_dims
    dims = range(ndim - 1) if kinds == ROWS else range(ndim) if kinds == ANY else kinds
    for d in dims:
        expect = layout.expect(tuple(args), d)
        if not isinstance(expect, dict):
            continue
        inputs = [None if i not in tensors else Replicate() if expect.get(i) is None else Shard(expect[i]) for i in range(len(args))]
        if loss is not None:
            reduction = _reduction(args, loss)
            if reduction == "mean":
                continue  # the global count of scored rows: replicated only
            outs = [Partial() if reduction == "sum" else inputs[loss[0]]]
        else:
            outs = [inputs[like] for like in layout.outputs]
        out.append((d, outs, inputs))
    return out


def _reduction(args: tuple[Any, ...], loss: tuple[int, int, int]) -> Any:
    return args[loss[2]] if len(args) > loss[2] else "mean"


def _rules(op: Op) -> Any:
    """The sharding function for ``op``'s forward custom op (register_sharding's contract:
    the op's arguments, DTensor specs for tensors; returns ``[(outputs, inputs), ...]``)."""

    def sharding(*args: Any, **_: Any) -> list[tuple[list[Any], list[Any]]]:
        return [(outs, inputs) for _d, outs, inputs in _strategies(op.id, args)]

    return sharding


def _saved_placements(kinds: tuple[str, ...], d: int | None) -> list[Any]:
    """The saved tensors' placements for the lead sharded on ``d`` (None: all replicated). A
    "rows" tensor is shaped like the lead's rows and a "lead" one like the lead (or an empty
    placeholder of its rank): both ``Shard(d)``; a "sum" over the rows is ``Partial()``."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    if d is None:
        return [Replicate()] * len(kinds)
    return [Shard(d) if kind in ("rows", "lead") else Partial() for kind in kinds]


def _train_rules(op: Op, compiled: Any) -> Any:
    """The sharding function for ``<op>_train(*args, grad_mask)``: the forward's strategies, with
    the saved tensors placed after the outputs."""
    kinds = compiled.saved_kinds

    def sharding(*rest: Any, **_: Any) -> list[tuple[list[Any], list[Any]]]:
        args = tuple(rest[:-1])
        return [(outs + _saved_placements(kinds, d), [*inputs, None]) for d, outs, inputs in _strategies(op.id, args)]

    return sharding


def _train_backward_rules(op: Op, compiled: Any) -> Any:
    """The sharding function for ``<op>_train_backward(*grad_outputs, *saved, *args, grad_mask)``:
    per strategy of the forward, the outputs' gradients placed like the outputs (``Replicate()``
    for a ``Partial()`` loss: its gradient is the same on every rank), the saved tensors as the
    training forward placed them, and per tensor argument its gradient: like the argument, or
    ``Partial()`` for a replicated argument of sharded rows."""
    from torch.distributed.tensor import Partial, Replicate

    kinds, n_out, tensor_args = compiled.saved_kinds, len(compiled.returns), compiled.tensor_args

    def sharding(*rest: Any, **_: Any) -> list[tuple[list[Any], list[Any]]]:
        grads, args = rest[:n_out], tuple(rest[n_out + len(kinds) : -1])
        out = []
        for d, outs, inputs in _strategies(op.id, args):
            grad_in = [None if g is None else Replicate() if o.is_partial() else o for g, o in zip(grads, outs)]
            grad_out = [
                Replicate() if inputs[i] is None or d is None else Partial() if inputs[i].is_replicate() else inputs[i] for i in tensor_args
            ]
            out.append((grad_out, [*grad_in, *_saved_placements(kinds, d), *inputs, None]))
        return out

    return sharding


def _key_on_every_argument(overload: Any) -> None:
    """Make DTensor's strategy cache key on all of ``overload``'s arguments. register_sharding
    hashes the arguments from the first ``int`` one on (none: only the tensors' specs), so two
    calls that differ in a float, str or bool[] argument would share one cached strategy and its
    output shapes (found by trying: a second ``grad_mask`` got the first one's gradient shapes).
    The schema info it registered is private API (a dataclass with ``static_argnum``, torch
    2.5 through 2.13; :func:`polykernel._compat.dtensor_schema_infos`): where it is not found,
    :func:`register` registers no rule at all."""
    infos = _compat.dtensor_schema_infos()
    info = infos.get(overload) if isinstance(infos, dict) else None
    if info is None or not dataclasses.is_dataclass(info) or not hasattr(info, "static_argnum"):
        return
    tensor_types = ("Tensor", "Optional[Tensor]")
    first = next((i for i, a in enumerate(overload._schema.arguments) if not a.kwarg_only and str(a.type) not in tensor_types), None)
    if first is not None and first < info.static_argnum:
        infos[overload] = dataclasses.replace(info, static_argnum=first)


def _trainable(op_id: str, compiled: Any) -> bool:
    """Whether ``op_id``'s training ops can have rules (every saved tensor has a placement)."""
    return op_id in _layouts and all(kind in PLACED_KINDS for kind in compiled.saved_kinds)


def register(op: Op, compiled: Any) -> None:
    """Register ``op``'s sharding rules on its custom ops (``compiled``: the library's
    ``CompiledOp``); once per op, and only for ops with a row layout."""
    global _rules_off
    if op.dtensor_layout is None or op.id in _done:
        return
    with _lock:
        if op.id in _done:
            return
        _layouts[op.id] = op.dtensor_layout
        if _compat.dtensor_schema_infos() is None:  # rules would share a strategy across options
            _rules_off = True
            _done.add(op.id)
            return
        try:
            from torch.distributed.tensor.experimental import register_sharding
        except ImportError:  # a torch without it (< 2.5): DTensor's default, an error naming the op
            return
        ops = [(compiled.forward, _rules(op))]
        if _trainable(op.id, compiled):
            ops += [(compiled.train, _train_rules(op, compiled)), (compiled.train_backward, _train_backward_rules(op, compiled))]
            _trained.add(op.id)
        for overload, rules in ops:
            register_sharding(overload)(rules)
            _key_on_every_argument(overload)
        _done.add(op.id)


def why_not(op_id: str, args: tuple[Any, ...]) -> str | None:
    """Why the training ops have no rule for this call of ``op_id`` on DTensors (``args``: the
    impl's positional arguments), or None when they do. Read at trace time. A mean loss over
    sharded rows never gets here: :func:`sharded_mean` turns it into a ``"sum"`` call, which the
    rules cover, over the global count (:func:`mean_of_sum`)."""
    if op_id not in _trained:
        if _rules_off and op_id in _layouts:
            return _NO_RULES
        return "the op has no row layout" if op_id not in _layouts else "its saved tensors have no placement"
    return None


def sharded_mean(op_id: str, args: tuple[Any, ...]) -> bool:
    """Whether this call of ``op_id`` on DTensors is a ``reduction="mean"`` loss over sharded
    rows (``args``: the impl's positional arguments; an omitted reduction is the default, mean)."""
    layout = _layouts.get(op_id)
    loss = None if layout is None else layout.loss_args
    if loss is None or _reduction(args, loss) != "mean":
        return False
    return not all(p.is_replicate() for p in getattr(args[0], "placements", ()))


def mean_of_sum(op_id: str, run: Any, args: tuple[Any, ...]) -> Any:
    """A mean loss over sharded rows as ``run`` (the compiled call: our custom ops) with
    ``reduction="sum"`` over the global count of scored rows (``args``: the impl's positional
    arguments, every one given). Both are ``Partial()``, so DTensor all-reduces them before
    dividing, and the division's backward scales the sum's gradients. DTensor's own mean
    ``nll_loss`` over sharded rows averages the ranks' means (``Partial(avg)``), wrong whenever
    the ranks score different numbers of rows; torch's mean, label smoothing included, is the
    sum over the non-ignored rows divided by their count (:func:`polykernel.distributed.dtensor.mean_of_scored`)."""
    from ..distributed import dtensor

    layout = _layouts[op_id]
    target, _, reduction = layout.loss_args  # type: ignore[misc]
    total = run(*args[:reduction], "sum", *args[reduction + 1 :])
    count, weight_sum = scored(layout, args[target], args)
    return dtensor.mean_of_scored(total, count.to(total.dtype), None if weight_sum is None else weight_sum.to(total.dtype))


def register_built() -> None:
    """Register the rules of every custom op the library has built so far."""
    from ..core import registry
    from .store import _built  # what library built (not library itself: no import circle)

    for op_id, compiled in dict(_built).items():
        register(registry.get_op(op_id), compiled)
